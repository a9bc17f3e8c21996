//! `fluxmem_py`: the execute steps of a planned embed or connect (`fluxmem_embed::plan`: the
//! texts a stage gives the model) and of a planned consolidate as Python classes,
//! for workers that keep their model loaded across batches (the Ray actors of
//! `integrations/ray`, `fluxmem_ray.actors`).
//!
//! ```python
//! import fluxmem_py
//! executor = fluxmem_py.EmbedExecutor("/data/store", "nightly-2026-12-07")  # loads the model once
//! # connect's ground queries: EmbedExecutor(store, run_id, stage="connect")
//! floats = executor.embed(keys, texts)  # little-endian f32, len(texts) * executor.dim of them
//! results = executor.embed_arrow(batch)  # pyarrow RecordBatch in (key, text), out (plan, key, vector)
//! ```
//!
//! An executor opens the run's plan (checked: its digest and the items file's SHA-256) and
//! loads the model the plan names, on the plan's device or the one given. `embed` checks that
//! each text hashes to its key and runs the model with the GIL released; the caller writes the
//! vectors as the plan's result rows (`plan`, `key`, `vector`), which the commit
//! (`fluxmem run P --stage embed --merge N`, or `--stage connect`) checks against the plan. Texts cross into Rust as
//! Python strings (one copy, which the model's tokenizer would make anyway) and the vectors come
//! back as one `bytes` object, which `numpy.frombuffer` and `pyarrow` wrap without copying.
//! `embed_arrow` passes whole batches through the Arrow C data interface instead (the PyCapsule
//! protocol, `__arrow_c_array__`): the items' columns are read in place and the result batch
//! is handed to pyarrow without a copy; this is what the Ray actors call.
//!
//! The execute step of a sharded consolidate is a class too, for workers that keep the
//! generator (and the embedder, judge or replay model) loaded across shards:
//!
//! ```python
//! executor = fluxmem_py.ConsolidateExecutor("/data/store", "nightly-2026-12-07")  # loads the models once
//! record = json.loads(executor.execute(3, 16))  # shard 3 of 16 into its staging store
//! ```
//!
//! It reads the run's shared cluster plan (`fluxmem run P --stage consolidate --plan`,
//! `fluxmem_consolidate::plan_shared`), which records the settings every shard runs with and
//! the models by name; it loads those models, and `execute` does what `fluxmem run P --stage
//! consolidate --shard I/N` does: the clusters of the plan that shard I owns, induced and matured
//! into the shard's staging store, finished with the plan's hash (the GIL released throughout).
//! The merge (`--stage consolidate --merge N`) checks that every shard followed the plan.
//!
//! Build: `maturin develop -m crates/fluxmem-py/Cargo.toml` in a virtualenv (scripts/test.sh
//! does it), or `maturin build --release` for a wheel to install on every node.

use arrow_array::ffi::{FFI_ArrowArray, FFI_ArrowSchema};
use arrow_array::{Array, RecordBatch, StructArray};
use fluxmem_consolidate::{ConsolidateOptions, ConsolidateReport, ModelNames, SharedSettings};
use fluxmem_embed::plan::Plan;
use fluxmem_models::{DeviceChoice, Embedder, Generator, GgufGenerator, Judge};
use fluxmem_store::{Shard, Writer};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

/// The execute step of one run's plan of a stage's texts, with its model loaded.
#[pyclass(module = "fluxmem_py", frozen)]
struct EmbedExecutor {
    plan: Plan,
    embedder: Box<dyn Embedder>,
    batch_size: usize,
}

#[pymethods]
impl EmbedExecutor {
    /// Opens the plan of `stage`'s texts (`embed` or `connect`) for `run_id` in the store at
    /// `store` and loads its model on `device` (default: the plan's, the pipeline's device),
    /// `batch_size` texts a forward.
    #[new]
    #[pyo3(signature = (store, run_id, device=None, batch_size=32, stage="embed"))]
    fn new(
        py: Python<'_>,
        store: PathBuf,
        run_id: &str,
        device: Option<&str>,
        batch_size: usize,
        stage: &str,
    ) -> PyResult<Self> {
        let plan = Plan::open_for(&store, stage, run_id)
            .map_err(value_error)?
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "{}: no {stage} plan for run id `{run_id}`; plan first with \
                 `fluxmem run P --run-id {run_id} --stage {stage} --plan`",
                    store.display()
                ))
            })?;
        let header = plan.header();
        let device: DeviceChoice = device
            .unwrap_or(&header.device)
            .parse()
            .map_err(value_error)?;
        let name = header.embedder.clone();
        let embedder = py
            .detach(|| fluxmem_models::open_embedder(&name, &device, Some(batch_size)))
            .map_err(runtime_error)?;
        Ok(EmbedExecutor {
            plan,
            embedder,
            batch_size,
        })
    }

    /// The stage whose texts the plan holds.
    #[getter]
    fn stage(&self) -> &str {
        &self.plan.header().stage
    }

    /// The plan's digest, which every result row carries in its `plan` column.
    #[getter]
    fn digest(&self) -> &str {
        &self.plan.header().digest
    }

    /// Floats per vector.
    #[getter]
    fn dim(&self) -> usize {
        self.plan.header().dim
    }

    /// The model's id.
    #[getter]
    fn model(&self) -> &str {
        &self.plan.header().model
    }

    /// The plan's folder (`items.parquet`, and `results/` where the vectors go).
    #[getter]
    fn plan_dir(&self) -> String {
        self.plan.dir().display().to_string()
    }

    /// The vectors of `texts` (rows of the plan's items with their `keys`), as little-endian
    /// 32-bit floats one vector after the other. The GIL is released while the model runs.
    fn embed<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        texts: Vec<String>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        if keys.len() != texts.len() {
            return Err(PyValueError::new_err(format!(
                "{} keys for {} texts",
                keys.len(),
                texts.len()
            )));
        }
        // The model and the conversion to bytes run with the GIL released.
        let bytes = py
            .detach(|| {
                let rows: Vec<(&str, &str)> = keys
                    .iter()
                    .zip(&texts)
                    .map(|(k, t)| (k.as_str(), t.as_str()))
                    .collect();
                let flat = self
                    .plan
                    .embed_rows(&rows, self.embedder.as_ref(), self.batch_size)?;
                Ok::<Vec<u8>, fluxmem_embed::Error>(
                    flat.iter().flat_map(|x| x.to_le_bytes()).collect(),
                )
            })
            .map_err(runtime_error)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The Arrow form of [`EmbedExecutor::embed`]: a batch of the plan's items (a
    /// `pyarrow.RecordBatch`, or any object with `__arrow_c_array__`, with `key` and `text`
    /// string columns) in, a `pyarrow.RecordBatch` of result rows (`plan`, `key`, `vector` as
    /// fixed-size lists of float32) out, in the items' order. Both cross the Arrow C data
    /// interface without a copy of their columns; the model runs with the GIL released.
    fn embed_arrow<'py>(
        &self,
        py: Python<'py>,
        batch: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let items = import_batch(batch)?;
        let results = py
            .detach(|| {
                self.plan
                    .execute(&items, self.embedder.as_ref(), self.batch_size)
            })
            .map_err(runtime_error)?;
        export_batch(py, results)
    }
}

/// The execute step of one run's sharded consolidate: the shards of its shared cluster plan,
/// with the plan's models loaded once.
#[pyclass(module = "fluxmem_py", frozen)]
struct ConsolidateExecutor {
    store: PathBuf,
    run_id: String,
    plan: SharedSettings,
    device: DeviceChoice,
    /// One shard at a time: the models are generated with mutably.
    models: Mutex<Loaded>,
}

/// The models of a consolidation, loaded.
struct Loaded {
    embedder: Box<dyn Embedder>,
    generator: Option<GgufGenerator>,
    judge: Option<Box<dyn Judge + Send>>,
    replayer: Option<GgufGenerator>,
}

#[pymethods]
impl ConsolidateExecutor {
    /// Opens the shared cluster plan of `run_id` in the store at `store` (refused, before any
    /// model loads, when the store has moved past it) and loads the models it names (fetched
    /// first where missing, as `fluxmem run` does) on `device` (default: the plan's, the
    /// pipeline's device).
    #[new]
    #[pyo3(signature = (store, run_id, device=None))]
    fn new(py: Python<'_>, store: PathBuf, run_id: &str, device: Option<&str>) -> PyResult<Self> {
        let stage_run = format!("{}@{run_id}", fluxmem_consolidate::STAGE);
        let plan = fluxmem_consolidate::shared_settings(&store, &stage_run)
            .map_err(value_error)?
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "{}: no shared consolidate plan for run id `{run_id}`; plan first with \
                 `fluxmem run P --run-id {run_id} --stage consolidate --plan`",
                    store.display()
                ))
            })?;
        let names = &plan.options.models;
        let device: DeviceChoice = device
            .unwrap_or(&names.device)
            .parse()
            .map_err(value_error)?;
        let models = py
            .detach(|| load_models(names, &device))
            .map_err(runtime_error)?;
        Ok(ConsolidateExecutor {
            store,
            run_id: run_id.to_string(),
            plan,
            device,
            models: Mutex::new(models),
        })
    }

    /// The shared plan's hash, which each shard's finish note names.
    #[getter]
    fn plan(&self) -> &str {
        &self.plan.sha256
    }

    /// The generator's name, as the plan records it (`none`: skills worded by template).
    #[getter]
    fn generator(&self) -> &str {
        &self.plan.options.models.generator
    }

    /// Runs shard `index` of `count` as `fluxmem run P --stage consolidate --shard I/N` does:
    /// the plan's clusters it owns into its staging store, which it then finishes. Returns the
    /// stage record (JSON text: `name`, `status`, `seconds`, `counts_in`, `counts_out`,
    /// `details`). The GIL is released throughout.
    fn execute(&self, py: Python<'_>, index: usize, count: usize) -> PyResult<String> {
        if count == 0 || index >= count {
            return Err(PyValueError::new_err(format!(
                "shard {index}/{count}: expected an index below a count of at least 1"
            )));
        }
        let shard = Shard { index, count };
        py.detach(|| self.execute_shard(shard))
            .map_err(runtime_error)
    }
}

impl ConsolidateExecutor {
    /// Shard `shard` into its staging store, finished; its stage record as JSON text.
    fn execute_shard(&self, shard: Shard) -> Result<String, String> {
        let started = Instant::now();
        // A shard that panicked left the models in an unknown state: this executor is done.
        let mut loaded = self.models.lock().map_err(|_| {
            "an earlier shard failed inside a model; start a new executor".to_string()
        })?;
        let report = self
            .consolidate(&mut loaded, shard)
            .map_err(|e| e.to_string())?;
        eprintln!(
            "fluxmem_py: consolidate shard {shard}: {}",
            report.summary_line()
        );
        let record = json!({
            "name": fluxmem_consolidate::STAGE,
            "status": report.status(),
            "seconds": started.elapsed().as_secs_f64(),
            "counts_in": BTreeMap::from(report.counts_in()),
            "counts_out": BTreeMap::from(report.counts_out()),
            "details": report,
        });
        Ok(record.to_string())
    }

    /// Runs the plan's clusters `shard` owns into its staging store, and finishes it with the
    /// plan's hash, as `fluxmem run P --stage consolidate --shard I/N` does.
    fn consolidate(
        &self,
        loaded: &mut Loaded,
        shard: Shard,
    ) -> Result<ConsolidateReport, fluxmem_consolidate::Error> {
        let Loaded {
            embedder,
            generator,
            judge,
            replayer,
        } = loaded;
        let mut models = fluxmem_consolidate::Models {
            embedder: embedder.as_ref(),
            generator: generator.as_mut().map(|g| g as &mut dyn Generator),
            judge: judge.as_mut().map(|j| j.as_mut() as &mut dyn Judge),
            replayer: replayer.as_mut().map(|r| r as &mut dyn Generator),
        };
        let options = ConsolidateOptions {
            shard,
            ..self.plan.options.clone()
        };
        let stage_run = format!("{}@{}", fluxmem_consolidate::STAGE, self.run_id);
        let mut writer = Writer::open_staging(&self.store, fluxmem_consolidate::STAGE, shard)?;
        let report = fluxmem_consolidate::consolidate_store(
            &mut writer,
            &mut models,
            &options,
            &stage_run,
            &self.device.device()?,
            &mut fluxmem_consolidate::NoProgress,
        )?;
        let note = match &report.shared_plan {
            Some(sha256) => json!({ "shared_plan": sha256 }),
            None => Value::Null,
        };
        writer.finish_staging_with(&stage_run, note)?;
        Ok(report)
    }
}

/// Loads the models `names` gives, each fetched first where the cache lacks it.
fn load_models(names: &ModelNames, device: &DeviceChoice) -> fluxmem_models::Result<Loaded> {
    let mut log = |line: &str| eprintln!("fluxmem_py: {line}");
    let needed = [
        Some(names.embedder.clone()),
        (names.generator != "none").then(|| names.generator.clone()),
        fluxmem_models::judge_model(&names.judge)?,
        fluxmem_models::eta_model(&names.eta)?,
    ];
    for name in needed.iter().flatten() {
        fluxmem_models::ensure_installed(name, &mut log)?;
    }
    let embedder = fluxmem_models::open_embedder(&names.embedder, device, names.embed_batch)?;
    let generator = if names.generator == "none" {
        None
    } else {
        let weights = names.generator_weights.parse().map_err(|reason| {
            fluxmem_models::Error::Unsupported {
                model: names.generator.clone(),
                reason: format!("the plan's models.generator_weights {reason}"),
            }
        })?;
        Some(fluxmem_models::load_generator(
            &names.generator,
            device,
            weights,
        )?)
    };
    Ok(Loaded {
        embedder,
        generator,
        judge: fluxmem_models::open_judge(&names.judge, device)?,
        replayer: fluxmem_models::open_replayer(&names.eta, &names.judge, device)?,
    })
}

/// A batch from Python, through the Arrow C data interface: `batch.__arrow_c_array__()` gives a
/// schema and an array capsule; the array is moved out of its capsule (which then releases
/// nothing) and its buffers are read in place.
fn import_batch(batch: &Bound<'_, PyAny>) -> PyResult<RecordBatch> {
    let capsules = batch.call_method0("__arrow_c_array__").map_err(|_| {
        PyValueError::new_err("expected an Arrow record batch (an object with __arrow_c_array__)")
    })?;
    let (schema, array): (Bound<'_, PyCapsule>, Bound<'_, PyCapsule>) = capsules.extract()?;
    let schema = schema
        .pointer_checked(Some(c"arrow_schema"))?
        .cast::<FFI_ArrowSchema>();
    let array = array
        .pointer_checked(Some(c"arrow_array"))?
        .cast::<FFI_ArrowArray>();
    // SAFETY: the capsules follow the PyCapsule interface: named `arrow_schema` and
    // `arrow_array` (checked above), they hold a valid schema and array. `from_raw` moves the
    // array out and leaves a released one in its place, which the capsule's destructor skips.
    let data = unsafe {
        let array = FFI_ArrowArray::from_raw(array.as_ptr());
        arrow_array::ffi::from_ffi(array, schema.as_ref())
    }
    .map_err(value_error)?;
    if !matches!(data.data_type(), arrow_schema::DataType::Struct(_)) {
        return Err(PyValueError::new_err(format!(
            "expected a record batch, got an array of {}",
            data.data_type()
        )));
    }
    if data.nulls().is_some_and(|nulls| nulls.null_count() > 0) {
        return Err(PyValueError::new_err(
            "expected a record batch, got a struct array with null rows",
        ));
    }
    Ok(RecordBatch::from(StructArray::from(data)))
}

/// A batch to Python, through the Arrow C data interface: its columns exported into capsules
/// that `pyarrow.RecordBatch._import_from_c_capsule` takes over without a copy (a capsule
/// never imported releases its batch when Python frees it).
fn export_batch(py: Python<'_>, batch: RecordBatch) -> PyResult<Bound<'_, PyAny>> {
    let data = StructArray::from(batch).into_data();
    let (array, schema) = arrow_array::ffi::to_ffi(&data).map_err(runtime_error)?;
    let schema = PyCapsule::new_with_value(py, schema, c"arrow_schema")?;
    let array = PyCapsule::new_with_value(py, array, c"arrow_array")?;
    py.import("pyarrow")?
        .getattr("RecordBatch")?
        .call_method1("_import_from_c_capsule", (schema, array))
}

fn value_error(error: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(error.to_string())
}

fn runtime_error(error: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(error.to_string())
}

/// The Python module.
#[pymodule]
fn fluxmem_py(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<EmbedExecutor>()?;
    module.add_class::<ConsolidateExecutor>()
}
