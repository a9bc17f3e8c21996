//! Tenants: the partition key of every stage. Connect, retrieval and the Stage II loop work
//! inside one tenant; nothing of another tenant is a candidate, a neighbour or a statistic.

use fluxmem_graph::Graph;
use std::collections::BTreeSet;

use crate::{Error, Result};

/// The tenant of a store without nodes (and of records that name none).
pub const DEFAULT_TENANT: &str = "default";

/// The tenants of `graph`'s nodes, sorted.
pub fn tenants(graph: &Graph) -> Vec<String> {
    let set: BTreeSet<&str> = graph.nodes.values().map(|n| n.tenant.as_str()).collect();
    set.into_iter().map(str::to_string).collect()
}

/// The tenant a query runs in: `requested` when the store has it; without a request, the
/// store's only tenant. A store with several tenants needs a request
/// ([`Error::TenantRequired`]); a tenant without nodes is [`Error::UnknownTenant`]. A store
/// without nodes answers in `requested`, or [`DEFAULT_TENANT`].
pub fn resolve_tenant(graph: &Graph, requested: Option<&str>) -> Result<String> {
    resolve_tenant_among(tenants(graph), requested)
}

/// [`resolve_tenant`] over the store's tenants, sorted (a reader that has not read the graph:
/// `Store::node_tenants`).
pub fn resolve_tenant_among(known: Vec<String>, requested: Option<&str>) -> Result<String> {
    match requested {
        Some(tenant) if known.is_empty() || known.iter().any(|t| t == tenant) => {
            Ok(tenant.to_string())
        }
        Some(tenant) => Err(Error::UnknownTenant {
            tenant: tenant.to_string(),
            tenants: known,
        }),
        None => match known.as_slice() {
            [] => Ok(DEFAULT_TENANT.to_string()),
            [only] => Ok(only.clone()),
            _ => Err(Error::TenantRequired { tenants: known }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fluxmem_graph::{Node, NodeBody, Semantic};

    fn graph_of(tenants: &[&str]) -> Graph {
        let mut graph = Graph::default();
        for (i, tenant) in tenants.iter().enumerate() {
            let body = NodeBody::Semantic(Semantic {
                source: "s".into(),
                position: i as i64,
                time: None,
                group: None,
            });
            graph.insert_node(Node::new(body, tenant, "fact", &[&i.to_string()]));
        }
        graph
    }

    #[test]
    fn one_tenant_is_the_default_and_several_need_a_choice() {
        assert_eq!(
            resolve_tenant(&Graph::default(), None).unwrap(),
            DEFAULT_TENANT
        );
        assert_eq!(
            resolve_tenant(&graph_of(&["acme", "acme"]), None).unwrap(),
            "acme"
        );
        let two = graph_of(&["globex", "acme", "acme"]);
        assert_eq!(
            tenants(&two),
            vec!["acme".to_string(), "globex".to_string()]
        );
        let err = resolve_tenant(&two, None).unwrap_err().to_string();
        assert!(
            err.contains("acme, globex") && err.contains("--tenant"),
            "{err}"
        );
        assert_eq!(resolve_tenant(&two, Some("globex")).unwrap(), "globex");
        let err = resolve_tenant(&two, Some("initech"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("initech") && err.contains("acme, globex"),
            "{err}"
        );
    }
}
