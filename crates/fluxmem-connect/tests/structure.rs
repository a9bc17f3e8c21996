//! Units with context and structure in Stage I: a turn indexed with the turn before it, stemmed
//! terms, and the adjacency lift of a strong match's neighbours in its source group.

use candle_core::Device;
use fluxmem_connect::{RetrievalConfig, SemanticIndex, Unembedded, Units};
use fluxmem_graph::{Embedding, Graph, Node, NodeBody, NodeId, Semantic};
use fluxmem_models::{Embedder, HashEmbedder};

/// Two sessions of one conversation, given out of position order, and a document without
/// groups.
const TURNS: [(&str, Option<&str>, i64, &str); 7] = [
    (
        "conv",
        Some("session_1"),
        2,
        "Alice: at the lake, by the old pier",
    ),
    (
        "conv",
        Some("session_1"),
        0,
        "Alice: I went camping last weekend",
    ),
    ("conv", Some("session_1"), 1, "Bob: where did you go for it"),
    (
        "conv",
        Some("session_2"),
        0,
        "Carol: the train to the city was late again",
    ),
    (
        "conv",
        Some("session_2"),
        1,
        "Dan: my laptop battery died during the meeting",
    ),
    ("doc", None, 1, "Refunds go back to the original card."),
    ("doc", None, 0, "Refunds take five days."),
];

fn graph(embedder: &HashEmbedder) -> (Graph, Vec<NodeId>) {
    let mut graph = Graph::default();
    let mut ids = Vec::new();
    for (i, (source, group, position, text)) in TURNS.iter().enumerate() {
        let body = NodeBody::Semantic(Semantic {
            source: (*source).into(),
            position: *position,
            time: None,
            group: group.map(str::to_string),
        });
        let node = Node::new(body, "t", text, &[source, &i.to_string()]);
        let vector = embedder.embed(&[text]).unwrap().remove(0);
        graph.upsert_embedding(Embedding {
            node_id: node.id.clone(),
            model_id: embedder.model_id().into(),
            text_sha256: String::new(),
            vector,
        });
        ids.push(node.id.clone());
        graph.insert_node(node);
    }
    (graph, ids)
}

fn index(graph: &Graph, units: Units) -> SemanticIndex {
    SemanticIndex::build_units(
        graph,
        "t",
        HashEmbedder::new(64).model_id(),
        &Device::Cpu,
        Unembedded::Fail,
        units,
    )
    .unwrap()
}

fn position_of(index: &SemanticIndex, id: &NodeId) -> usize {
    (0..index.len()).find(|&i| index.id(i) == id).unwrap()
}

#[test]
fn neighbours_follow_position_within_a_source_group() {
    let embedder = HashEmbedder::new(64);
    let (graph, ids) = graph(&embedder);
    let index = index(&graph, Units::PLAIN);
    let at = |turn: usize| position_of(&index, &ids[turn]);
    let neighbours = |turn: usize| index.neighbours(at(turn));
    // session_1 in position order: turn 1, turn 2, turn 0.
    assert_eq!(neighbours(1), [None, Some(at(2))]);
    assert_eq!(neighbours(2), [Some(at(1)), Some(at(0))]);
    assert_eq!(neighbours(0), [Some(at(2)), None]);
    // Sessions do not join, and a document without groups is one group.
    assert_eq!(neighbours(3), [None, Some(at(4))]);
    assert_eq!(neighbours(4), [Some(at(3)), None]);
    assert_eq!(neighbours(6), [None, Some(at(5))]);
    assert_eq!(neighbours(5), [Some(at(6)), None]);
}

#[test]
fn a_unit_with_context_is_found_by_the_words_of_the_turn_before_it() {
    let embedder = HashEmbedder::new(64);
    let (graph, ids) = graph(&embedder);
    // "camping" is said in turn 1; the answer is turn 2 ("where did you go for it").
    let plain = index(&graph, Units::PLAIN).bm25("camping", 10);
    assert_eq!(
        plain.iter().map(|c| &c.node_id).collect::<Vec<_>>(),
        vec![&ids[1]],
        "plain units: only the turn that says it"
    );
    let previous = index(
        &graph,
        Units {
            previous: true,
            stem: false,
        },
    )
    .bm25("camping", 10);
    assert!(
        previous.iter().any(|c| c.node_id == ids[2]),
        "the reply carries the turn before it"
    );
    assert!(
        !previous.iter().any(|c| c.node_id == ids[0]),
        "but not two turns back"
    );
    // Stemming: "camped" meets "camping" only with stemmed terms.
    assert!(index(&graph, Units::PLAIN).bm25("camped", 10).is_empty());
    let stemmed = index(
        &graph,
        Units {
            previous: false,
            stem: true,
        },
    )
    .bm25("camped", 10);
    assert_eq!(
        stemmed.iter().map(|c| &c.node_id).collect::<Vec<_>>(),
        vec![&ids[1]]
    );
    // An index re-unitised from a plain one ranks as one built with those units.
    let rebuilt = index(&graph, Units::PLAIN).with_units(Units::CONTEXT);
    for query in ["camping", "camped", "where did you go"] {
        assert_eq!(
            rebuilt.bm25(query, 10),
            index(&graph, Units::CONTEXT).bm25(query, 10),
            "{query}"
        );
    }
    // The stored text is unchanged: the context is in the BM25 index only.
    let with_context = index(&graph, Units::CONTEXT);
    assert_eq!(
        with_context.text(position_of(&with_context, &ids[2])),
        TURNS[2].3
    );
}

#[test]
fn adjacency_lifts_the_neighbours_of_a_strong_match() {
    let embedder = HashEmbedder::new(64);
    let (graph, ids) = graph(&embedder);
    let index = index(&graph, Units::PLAIN);
    let query = "train city late";
    let vector = embedder.embed(&[query]).unwrap().remove(0);
    let rank = |adjacency: f32| {
        let config = RetrievalConfig {
            adjacency,
            ..RetrievalConfig::default()
        };
        let ranked = index.hybrid(query, &vector, &config, None).unwrap();
        ranked.iter().map(|c| c.node_id.clone()).collect::<Vec<_>>()
    };
    let (off, on) = (rank(0.0), rank(0.9));
    assert_eq!(off[0], ids[3], "the match itself leads either way");
    assert_eq!(on[0], ids[3]);
    let place = |ranking: &[NodeId], id: &NodeId| ranking.iter().position(|x| x == id).unwrap();
    assert!(
        place(&off, &ids[4]) > 1,
        "without structure its neighbour is not next: {:?}",
        place(&off, &ids[4])
    );
    let names = |r: &[NodeId]| {
        r.iter()
            .map(|id| ids.iter().position(|x| x == id).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        place(&on, &ids[4]),
        1,
        "with structure the match's neighbour in its session comes next: {:?} {:?}",
        names(&off),
        names(&on)
    );
    assert_eq!(rank(0.0), off, "the same query ranks the same");
}

#[test]
fn units_parse_from_the_flag() {
    assert_eq!("plain".parse::<Units>().unwrap(), Units::PLAIN);
    assert_eq!("context".parse::<Units>().unwrap(), Units::CONTEXT);
    assert_eq!(
        "stem".parse::<Units>().unwrap(),
        Units {
            previous: false,
            stem: true
        }
    );
    assert_eq!("previous,stem".parse::<Units>().unwrap(), Units::CONTEXT);
    let error = "prev".parse::<Units>().unwrap_err();
    assert!(error.contains("`prev`"), "{error}");
}

#[test]
fn entity_lifts_what_the_named_speaker_said() {
    let embedder = HashEmbedder::new(64);
    let mut graph = Graph::default();
    let turns = [
        ("Bob", "Bob: what did you think of the weather"),
        ("Alice", "Alice: I stayed in because of the weather"),
        ("Alice", "Alice: we painted the kitchen"),
    ];
    let mut ids = Vec::new();
    for (i, (speaker, text)) in turns.iter().enumerate() {
        let body = NodeBody::Semantic(Semantic {
            source: "conv".into(),
            position: i as i64,
            time: None,
            group: Some("s1".into()),
        });
        let mut node = Node::new(body, "t", text, &["conv", &i.to_string()]);
        node.metadata.insert("speaker".into(), (*speaker).into());
        let vector = embedder.embed(&[text]).unwrap().remove(0);
        graph.upsert_embedding(Embedding {
            node_id: node.id.clone(),
            model_id: embedder.model_id().into(),
            text_sha256: String::new(),
            vector,
        });
        ids.push(node.id.clone());
        graph.insert_node(node);
    }
    let index = index(&graph, Units::PLAIN);
    let rank = |query: &str, entity: f32| {
        let vector = embedder.embed(&[query]).unwrap().remove(0);
        let config = RetrievalConfig {
            entity,
            ..RetrievalConfig::default()
        };
        let ranked = index.hybrid(query, &vector, &config, None).unwrap();
        ranked
            .iter()
            .map(|c| ids.iter().position(|x| *x == c.node_id).unwrap())
            .collect::<Vec<_>>()
    };
    // Bob's turn has the question's words; without entities it leads whoever is named.
    assert_eq!(rank("what did alice think of the weather", 0.0)[0], 0);
    assert_eq!(rank("what did Alice think of the weather", 0.0)[0], 0);
    // Named, Alice's turns gain: hers about the weather leads.
    assert_eq!(rank("what did Alice think of the weather", 1.0)[0], 1);
    // The lift is shown on each candidate and is part of its score.
    let query = "what did Alice think of the weather";
    let vector = embedder.embed(&[query]).unwrap().remove(0);
    let lifted = index
        .hybrid(
            query,
            &vector,
            &RetrievalConfig {
                entity: 1.0,
                ..RetrievalConfig::default()
            },
            None,
        )
        .unwrap();
    let plain = index
        .hybrid(query, &vector, &RetrievalConfig::default(), None)
        .unwrap();
    for c in &lifted {
        let said_by_alice = c.node_id != ids[0];
        assert_eq!(c.structure.speaker, if said_by_alice { 1.0 } else { 0.0 });
        let before = plain.iter().find(|p| p.node_id == c.node_id).unwrap();
        assert!((c.score - before.score - c.structure.total()).abs() < 1e-6);
    }
    // Named in any case, possessive too: with a lift above the largest fused score (1.5 with
    // the default weights), every turn of hers comes before Bob's.
    for query in [
        "what did Alice's sister think of the weather",
        "what did ALICE\u{2019}s sister think of the weather",
    ] {
        assert_eq!(rank(query, 0.0)[0], 0, "{query}");
        assert_eq!(rank(query, 2.0), vec![1, 2, 0], "{query}");
    }
    // A query that names no speaker (or names one inside another word) ranks as without it.
    assert_eq!(
        rank("what did you think of the weather", 1.0),
        rank("what did you think of the weather", 0.0)
    );
    assert_eq!(
        rank("what did malice think of the weather", 1.0),
        rank("what did malice think of the weather", 0.0)
    );
}

#[test]
fn the_dense_query_leaves_the_named_speakers_to_the_entity_lift() {
    let embedder = HashEmbedder::new(64);
    let mut graph = Graph::default();
    for (i, speaker) in ["Caroline", "Melanie Jones"].iter().enumerate() {
        let body = NodeBody::Semantic(Semantic {
            source: "conv".into(),
            position: i as i64,
            time: None,
            group: None,
        });
        let text = format!("{speaker}: hello");
        let mut node = Node::new(body, "t", &text, &["conv", &i.to_string()]);
        node.metadata.insert("speaker".into(), (*speaker).into());
        let vector = embedder.embed(&[text.as_str()]).unwrap().remove(0);
        graph.upsert_embedding(Embedding {
            node_id: node.id.clone(),
            model_id: embedder.model_id().into(),
            text_sha256: String::new(),
            vector,
        });
        graph.insert_node(node);
    }
    let index = index(&graph, Units::PLAIN);
    let on = RetrievalConfig {
        entity: 0.3,
        ..RetrievalConfig::default()
    };
    assert_eq!(
        index
            .dense_query("What did Caroline research?", &on)
            .as_deref(),
        Some("What did research?")
    );
    // Possessives and first names of longer names; every named speaker goes.
    assert_eq!(
        index
            .dense_query("Where did Melanie's kids and caroline go?", &on)
            .as_deref(),
        Some("Where did kids and go?")
    );
    // Nothing named, only names, or entities off: the query is embedded as it is.
    assert_eq!(index.dense_query("What did Jones research?", &on), None);
    assert_eq!(index.dense_query("Caroline?", &on), None);
    assert_eq!(
        index.dense_query("What did Caroline research?", &RetrievalConfig::default()),
        None
    );
}
