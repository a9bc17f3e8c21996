"""Reads a fluxmem store's shards with pyarrow and DuckDB, as an outside user would.

Usage: read_shards.py STORE EXPECTED_JSON
EXPECTED_JSON: {"nodes": {"semantic": N, ...}, "embedding_dim": D, "embeddings": N,
                "probe": {"locator": "...", "text": "..."}}
Exits non-zero with a message on any mismatch.
"""
import glob
import json
import os
import sys

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq


def main(store, expected):
    manifest = json.load(open(os.path.join(store, "manifest.json")))
    for shard in manifest["shards"]:
        table = pq.read_table(os.path.join(store, shard["file"]))
        assert table.num_rows == shard["rows"], (shard["file"], table.num_rows, shard["rows"])

    nodes = pa.concat_tables(
        [pq.read_table(os.path.join(store, s["file"])) for s in manifest["shards"] if s["table"] == "nodes"]
    )
    kinds = {}
    for kind in nodes.column("kind").to_pylist():
        kinds[kind] = kinds.get(kind, 0) + 1
    for kind, count in expected["nodes"].items():
        assert kinds.get(kind, 0) == count, ("pyarrow node count", kind, kinds.get(kind, 0), count)
    assert nodes.schema.field("created_at").type == pa.timestamp("ms", tz="UTC"), nodes.schema.field("created_at").type

    probe = expected["probe"]
    rows = nodes.filter(pa.compute.equal(nodes.column("source_locator"), probe["locator"])).to_pylist()
    assert len(rows) == 1 and rows[0]["text"] == probe["text"], rows
    assert json.loads(rows[0]["metadata"])["dia_id"] == probe["locator"].split("/")[-1]

    embeddings = [s for s in manifest["shards"] if s["table"] == "embeddings"]
    table = pa.concat_tables([pq.read_table(os.path.join(store, s["file"])) for s in embeddings])
    vector_type = table.schema.field("vector").type
    assert pa.types.is_fixed_size_list(vector_type), vector_type
    assert vector_type.value_type == pa.float32() and vector_type.list_size == expected["embedding_dim"], vector_type
    assert table.num_rows == expected["embeddings"], table.num_rows
    first = table.column("vector")[0].as_py()
    assert abs(first[0] - expected["first_vector_value"]) < 1e-6, first

    con = duckdb.connect()
    pattern = os.path.join(store, "shards", "nodes-*.parquet")
    counts = dict(con.execute(f"SELECT kind, count(*) FROM read_parquet('{pattern}') GROUP BY kind").fetchall())
    for kind, count in expected["nodes"].items():
        assert counts.get(kind, 0) == count, ("duckdb node count", kind, counts, count)
    steps = glob.glob(os.path.join(store, "shards", "steps-*.parquet"))
    if steps:
        n = con.execute(f"SELECT count(*) FROM read_parquet({steps!r})").fetchone()[0]
        assert n > 0
    dim = con.execute(
        f"SELECT len(vector) FROM read_parquet('{os.path.join(store, 'shards', 'embeddings-*.parquet')}') LIMIT 1"
    ).fetchone()[0]
    assert dim == expected["embedding_dim"], dim
    print(f"ok: pyarrow {pa.__version__} and duckdb {duckdb.__version__} read {len(manifest['shards'])} shards, nodes {kinds}")


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
