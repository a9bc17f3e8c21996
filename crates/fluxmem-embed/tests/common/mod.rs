//! What the embed tests share: a weight-free embedder that counts the texts it embeds and fails
//! the calls a rule picks (a simulated crash).

use fluxmem_graph::{Changed, Edit, Episode, Node, NodeBody, Outcome, Step};
use fluxmem_models::{Embedder, HashEmbedder};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The 16-dimensional hashing embedder, counting texts and failing the calls `fails` picks
/// (by their 0-based number).
pub struct Scripted {
    inner: HashEmbedder,
    /// Texts embedded.
    pub texts: AtomicUsize,
    calls: AtomicUsize,
    fails: Box<dyn Fn(usize) -> bool + Send + Sync>,
}

impl Scripted {
    /// Fails every call from the `n`-th on (`usize::MAX`: never).
    #[allow(dead_code)] // used by embed.rs, not by plan.rs
    pub fn failing_after(n: usize) -> Scripted {
        Scripted::new(Box::new(move |call| call >= n))
    }

    /// Fails the first `n` calls (an actor that dies on its first batch and is retried).
    #[allow(dead_code)] // used by plan.rs, not by embed.rs
    pub fn failing_first(n: usize) -> Scripted {
        Scripted::new(Box::new(move |call| call < n))
    }

    fn new(fails: Box<dyn Fn(usize) -> bool + Send + Sync>) -> Scripted {
        Scripted {
            inner: HashEmbedder::new(16),
            texts: AtomicUsize::new(0),
            calls: AtomicUsize::new(0),
            fails,
        }
    }
}

impl Embedder for Scripted {
    fn model_id(&self) -> &str {
        self.inner.model_id()
    }
    fn dim(&self) -> usize {
        self.inner.dim()
    }
    fn embed(&self, texts: &[&str]) -> fluxmem_models::Result<Vec<Vec<f32>>> {
        if (self.fails)(self.calls.fetch_add(1, Ordering::SeqCst)) {
            return Err(fluxmem_models::Error::Tokenizer("simulated crash".into()));
        }
        self.texts.fetch_add(texts.len(), Ordering::SeqCst);
        self.inner.embed(texts)
    }
    fn count_tokens(&self, text: &str) -> fluxmem_models::Result<usize> {
        self.inner.count_tokens(text)
    }
}

/// An episode of `conversation-1` with these actions: the same id whatever its steps.
#[allow(dead_code)] // not every test file uses every helper
pub fn conversation(actions: &[&str]) -> Node {
    let steps = actions
        .iter()
        .map(|a| Step {
            action: a.to_string(),
            ..Step::default()
        })
        .collect();
    let body = NodeBody::Episodic(Episode {
        steps,
        outcome: Outcome::default(),
    });
    Node::new(body, "default", "refund my order", &["conversation-1"])
}

/// The edit ingest records when `short` was logged again, longer, as `long`.
#[allow(dead_code)] // not every test file uses every helper
pub fn grown(short: &Node, long: &Node) -> Edit {
    Edit::new(
        "ingest",
        "night-2",
        "episode_grown",
        Changed::Node(Some(short), Some(long)),
        "a later version",
        0,
    )
}
