//! Serialising the retrieved subgraph into a context string under a token budget.

use fluxmem_graph::{Graph, NodeBody, NodeId};
use serde::Serialize;

use crate::fusion::Signals;
use crate::Result;

/// One item of a context, with why it is there.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ContextItem {
    /// The node.
    pub node_id: NodeId,
    /// `semantic`, `episodic` or `procedural`.
    pub kind: String,
    /// The node's tenant.
    pub tenant: String,
    /// Where it came from (source file and locator).
    pub source: String,
    /// Its time, as the source writes it.
    pub time: Option<String>,
    /// Rank in the candidate list it was taken from (0-based).
    pub rank: usize,
    /// Raw signals.
    pub signals: Signals,
    /// Fused score.
    pub score: f32,
    /// Why it was included.
    pub why: String,
    /// Its line in the context.
    pub line: String,
    /// Tokens of that line.
    pub tokens: usize,
}

/// A packed context.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Context {
    /// The budget it was packed under.
    pub budget: usize,
    /// Tokens used.
    pub tokens: usize,
    /// The items, in rank order.
    pub items: Vec<ContextItem>,
}

impl Context {
    /// The context string given to an agent.
    pub fn text(&self) -> String {
        self.items
            .iter()
            .map(|item| item.line.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The line a node contributes to a context.
pub fn line(graph: &Graph, id: &NodeId) -> String {
    let Some(node) = graph.nodes.get(id) else {
        return String::new();
    };
    match &node.body {
        NodeBody::Semantic(s) => match &s.time {
            Some(time) => format!("[{time}] {}", node.text),
            None => node.text.clone(),
        },
        NodeBody::Episodic(e) => {
            let outcome = match e.outcome.success {
                Some(true) => "succeeded",
                Some(false) => "failed",
                None => "outcome unknown",
            };
            format!("[past task, {outcome}] {}", node.text)
        }
        NodeBody::Procedural(_) => format!("[skill] {}", node.text),
    }
}

/// Packs ranked `(node, signals, score, why)` entries greedily in rank order: an item that does
/// not fit in what is left of `budget` is skipped and smaller later items may still fit. Tokens
/// are counted by `count_tokens` on each line plus one for the newline between lines.
pub fn pack(
    graph: &Graph,
    ranked: &[(NodeId, Signals, f32, String)],
    budget: usize,
    count_tokens: &dyn Fn(&str) -> Result<usize>,
) -> Result<Context> {
    let mut items = Vec::new();
    let mut used = 0;
    for (rank, (id, signals, score, why)) in ranked.iter().enumerate() {
        let Some(node) = graph.nodes.get(id) else {
            continue;
        };
        let text = line(graph, id);
        let tokens = count_tokens(&text)? + usize::from(!items.is_empty());
        if used + tokens > budget {
            continue;
        }
        used += tokens;
        let time = match &node.body {
            NodeBody::Semantic(s) => s.time.clone(),
            _ => None,
        };
        items.push(ContextItem {
            node_id: id.clone(),
            kind: node.kind().as_str().to_string(),
            tenant: node.tenant.clone(),
            source: format!("{} {}", node.source_file, node.source_locator),
            time,
            rank,
            signals: *signals,
            score: *score,
            why: why.clone(),
            line: text,
            tokens,
        });
    }
    Ok(Context {
        budget,
        tokens: used,
        items,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fluxmem_graph::{Node, Semantic};

    fn graph_of(texts: &[&str]) -> (Graph, Vec<NodeId>) {
        let mut graph = Graph::default();
        let mut ids = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            let body = NodeBody::Semantic(Semantic {
                source: "s".into(),
                position: i as i64,
                time: None,
                group: None,
            });
            let node = Node::new(body, "t", text, &[text]);
            ids.push(node.id.clone());
            graph.insert_node(node);
        }
        (graph, ids)
    }

    #[test]
    fn packs_in_rank_order_skipping_what_does_not_fit() {
        // Word counts: 3, 5, 2, 1 tokens; newline between lines costs 1.
        let (graph, ids) = graph_of(&["one two three", "a b c d e", "x y", "z"]);
        let ranked: Vec<(NodeId, Signals, f32, String)> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                (
                    id.clone(),
                    Signals::default(),
                    1.0 - i as f32 / 10.0,
                    "test".into(),
                )
            })
            .collect();
        let words = |text: &str| -> Result<usize> { Ok(text.split_whitespace().count()) };
        let context = pack(&graph, &ranked, 8, &words).unwrap();
        let texts: Vec<&str> = context.items.iter().map(|i| i.line.as_str()).collect();
        // 3 fits (3); 5+1 would make 9 > 8, skipped; 2+1 fits (6); 1+1 fits (8).
        assert_eq!(texts, vec!["one two three", "x y", "z"]);
        assert_eq!(context.tokens, 8);
        assert_eq!(context.text(), "one two three\nx y\nz");
        assert_eq!(context.items[1].rank, 2);
        assert!(pack(&graph, &ranked, 0, &words).unwrap().items.is_empty());
        let all = pack(&graph, &ranked, 100, &words).unwrap();
        assert_eq!(all.tokens, 3 + 6 + 3 + 2);
    }
}
