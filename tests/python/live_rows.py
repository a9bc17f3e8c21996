"""Live rows of a fluxmem store as DuckDB sees them: the shards the manifest lists, and for a
key the row of the highest commit (the store's upsert rule). Prints one JSON object: per table
the live row count and a SHA-256 over the sorted rows (the edit log: over its rows in commit
order).

Usage: live_rows.py STORE
"""
import hashlib
import json
import os
import sys

import duckdb

KEYS = {"nodes": ["id"], "edges": ["src", "dst", "kind"], "embeddings": ["node_id", "model_id"]}


def main(store):
    manifest = json.load(open(os.path.join(store, "manifest.json")))
    con = duckdb.connect()
    out = {}
    for table in ["nodes", "edges", "embeddings", "edits"]:
        shards = [s for s in manifest["shards"] if s["table"] == table]
        if not shards:
            out[table] = {"rows": 0, "sha256": None}
            continue
        con.execute("CREATE OR REPLACE TABLE commits (file VARCHAR, c BIGINT)")
        con.executemany("INSERT INTO commits VALUES (?, ?)", [[os.path.join(store, s["file"]), s["commit"]] for s in shards])
        files = [os.path.join(store, s["file"]) for s in shards]
        source = f"(SELECT t.*, commits.c AS commit_ FROM read_parquet({files!r}, filename=true, file_row_number=true) t JOIN commits ON t.filename = commits.file)"
        if table in KEYS:
            key = ", ".join(KEYS[table])
            query = (f"SELECT * EXCLUDE (filename, file_row_number, commit_) FROM {source} "
                     f"QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY commit_ DESC, file_row_number DESC) = 1 ORDER BY {key}")
        else:
            query = f"SELECT * EXCLUDE (filename, file_row_number, commit_) FROM {source} ORDER BY commit_, filename, file_row_number"
        rows = con.execute(query).fetchall()
        digest = hashlib.sha256(json.dumps([list(map(str, r)) for r in rows]).encode()).hexdigest()
        out[table] = {"rows": len(rows), "sha256": digest}
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1])
