//! Smoke test with a real generator (SmolLM2-135M-Instruct, Q8 weights, CPU): one
//! induction from three tiny episodes must give a readable skill. The models are fetched into
//! the cache (`FLUXMEM_MODELS`, default `~/.cache/fluxmem/models`) before the tests run.

use fluxmem_consolidate::{induce_skill, parse_skill, ConsolidateOptions, EXAMPLE_NAME};
use fluxmem_graph::{Episode, Node, NodeBody, Outcome, Step};
use fluxmem_models::{DeviceChoice, Generator, WeightPath};

fn episode(task: &str, actions: &[&str]) -> Node {
    let steps = actions
        .iter()
        .map(|a| Step {
            observation: "OK.".into(),
            action: a.to_string(),
            ..Default::default()
        })
        .collect();
    let outcome = Outcome {
        success: Some(true),
        reward: Some(1.0),
        feedback: None,
    };
    Node::new(
        NodeBody::Episodic(Episode { steps, outcome }),
        "default",
        task,
        &[task],
    )
}

#[test]
fn smollm2_induces_a_readable_skill_from_three_episodes() {
    let episodes = [
        episode(
            "water the plant in the kitchen",
            &[
                "go to cabinet 1",
                "take wateringcan 1 from cabinet 1",
                "go to sinkbasin 1",
                "fill wateringcan 1 with sinkbasin 1",
                "go to plant 1",
                "water plant 1 with wateringcan 1",
            ],
        ),
        episode(
            "water the plant in the bedroom",
            &[
                "go to shelf 2",
                "take wateringcan 1 from shelf 2",
                "go to sinkbasin 1",
                "fill wateringcan 1 with sinkbasin 1",
                "go to plant 2",
                "water plant 2 with wateringcan 1",
            ],
        ),
        episode(
            "water the plant on the balcony",
            &[
                "go to drawer 3",
                "open drawer 3",
                "take wateringcan 2 from drawer 3",
                "go to sinkbasin 1",
                "fill wateringcan 2 with sinkbasin 1",
                "go to plant 1",
                "water plant 1 with wateringcan 2",
            ],
        ),
    ];
    let refs: Vec<&Node> = episodes.iter().collect();
    let mut generator = fluxmem_models::load_generator(
        "smollm2-135m-instruct-q4_1",
        &DeviceChoice::Cpu,
        WeightPath::Q8,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let options = ConsolidateOptions {
        max_tokens: 160,
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let skill = match induce_skill(&refs, None, &mut generator, &options).unwrap() {
        Ok(skill) => skill,
        Err(attempts) => panic!("no readable skill: {attempts:#?}"),
    };
    let usage = generator.usage();
    eprintln!(
        "{}\n{} calls, {} + {} tokens, {:.1}s",
        skill.render(),
        usage.calls,
        usage.prompt_tokens,
        usage.generated_tokens,
        started.elapsed().as_secs_f64()
    );
    assert!(!skill.name.is_empty() && skill.name != EXAMPLE_NAME);
    assert!(skill.steps.len() >= 2);
    assert_eq!(
        parse_skill(&skill.render()).unwrap(),
        skill,
        "the rendered skill parses back to itself"
    );
    assert!(usage.calls <= 2 && usage.generated_tokens <= 2 * 160);
}
