//! Purity and NMI of the consolidate stage's k-means against a label read from each episode's
//! source locator (its `_`-separated part LABEL_PART: ALFWorld names are
//! `<style>_<task type>_<n>`, and the store holds no label), without any generator call (same
//! function, options and episode order as `fluxmem consolidate` for a single-tenant store):
//!
//! ```text
//! cargo run --example cluster_purity -- STORE LABEL_PART SEED K [K ...]
//! cargo run --example cluster_purity -- /tmp/alf 1 0 3 6
//! ```

use candle_core::Device;
use fluxmem_consolidate::{kmeans, KMeansOptions};
use fluxmem_graph::NodeKind;
use std::collections::BTreeMap;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [store, part, seed, ks @ ..] = args.as_slice() else {
        return Err("usage: cluster_purity STORE LABEL_PART SEED K [K ...]".into());
    };
    let part: usize = part.parse()?;
    let graph = fluxmem_store::Store::open(store)?.load()?;
    let mut labels = Vec::new();
    let mut vectors = Vec::new();
    for node in graph
        .nodes
        .values()
        .filter(|n| n.kind() == NodeKind::Episodic)
    {
        let Some(embedding) = graph
            .embeddings
            .iter()
            .find(|((id, _), _)| id == &node.id)
            .map(|(_, e)| e)
        else {
            return Err(format!("{} has no embedding", node.id).into());
        };
        labels.push(
            node.source_locator
                .split('_')
                .nth(part)
                .unwrap_or("?")
                .to_string(),
        );
        vectors.push(embedding.vector.clone());
    }
    for k in ks {
        let options = KMeansOptions {
            clusters: Some(k.parse()?),
            seed: seed.parse()?,
            ..Default::default()
        };
        let clustering = kmeans(&vectors, &options, &Device::Cpu)?;
        let (purity, nmi, composition) = scores(&clustering.assignment, &labels);
        println!(
            "k={k} n={} purity={purity:.3} nmi={nmi:.3} {composition:?}",
            labels.len()
        );
    }
    Ok(())
}

fn scores(assignment: &[usize], labels: &[String]) -> (f64, f64, Vec<BTreeMap<String, usize>>) {
    let n = labels.len() as f64;
    let k = assignment.iter().max().map_or(0, |m| m + 1);
    let mut composition: Vec<BTreeMap<String, usize>> = vec![BTreeMap::new(); k];
    for (cluster, label) in assignment.iter().zip(labels) {
        *composition[*cluster].entry(label.clone()).or_default() += 1;
    }
    let purity = composition
        .iter()
        .map(|c| c.values().max().copied().unwrap_or(0))
        .sum::<usize>() as f64
        / n;
    let mut totals: BTreeMap<&str, usize> = BTreeMap::new();
    for label in labels {
        *totals.entry(label).or_default() += 1;
    }
    let entropy = |counts: &mut dyn Iterator<Item = usize>| {
        -counts
            .filter(|&c| c > 0)
            .map(|c| c as f64 / n * (c as f64 / n).ln())
            .sum::<f64>()
    };
    let sizes: Vec<usize> = composition.iter().map(|c| c.values().sum()).collect();
    let mut mi = 0.0;
    for (cluster, counts) in composition.iter().enumerate() {
        for (label, &c) in counts {
            mi += c as f64 / n
                * (c as f64 * n / (sizes[cluster] as f64 * totals[label.as_str()] as f64)).ln();
        }
    }
    let h = entropy(&mut sizes.iter().copied()) + entropy(&mut totals.values().copied());
    let nmi = if h > 0.0 { 2.0 * mi / h } else { 1.0 };
    (purity, nmi, composition)
}
