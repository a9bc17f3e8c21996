//! The FluxMem memory graph: what fluxmem stores and every stage reads and edits.
//!
//! Three node layers ([`NodeKind`]):
//! - **semantic** nodes hold static knowledge (a document chunk, an API note, a dialogue turn);
//! - **episodic** nodes hold one task: its ordered [`Step`]s and its [`Outcome`];
//! - **procedural** nodes hold a distilled skill with its versions and PEMS history.
//!
//! Edges ([`EdgeKind`]) are `ground` (semantic -> episodic), `distill` (episodic ->
//! procedural) and `link` (association links created by the stages). Every node id is
//! content-addressed ([`NodeId::content`]), so re-ingesting the same record is idempotent.
//!
//! [`Graph`] is the in-memory view a store commit loads into; [`schema`] maps it to the Arrow
//! record batches that the store writes as Parquet shards.
//!
//! ```
//! use fluxmem_graph::{Graph, Node, NodeBody, Semantic};
//!
//! let node = Node::new(
//!     NodeBody::Semantic(Semantic { source: "notes.md".into(), position: 0, time: None, group: None }),
//!     "default",
//!     "Refunds take 5 business days.",
//!     &["notes.md", "0"],
//! );
//! let mut graph = Graph::default();
//! assert!(graph.insert_node(node.clone()));
//! assert!(!graph.insert_node(node), "same content, same id: a duplicate");
//! assert_eq!(graph.stats().semantic, 1);
//! ```

mod edge;
mod edit;
mod error;
mod graph;
mod id;
mod node;
mod progress;
pub mod schema;

pub use edge::{Edge, EdgeKey, EdgeKind};
pub use edit::{Changed, Edit, EPISODE_GROWN};
pub use error::{Error, Result};
pub use graph::{normalize, Embedding, Graph, GraphStats};
pub use id::{hex, sha256_hex, IdMap, IdSet, NodeId};
pub use node::{Episode, Node, NodeBody, NodeKind, Outcome, Semantic, Skill, Step, ToolCall};
pub use progress::{NoProgress, Progress};
