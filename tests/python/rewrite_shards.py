"""Rewrites every shard of a fluxmem store with pyarrow's defaults, as an external writer
(a Spark or pandas job) would: the Parquet standard's list encoding (`element` items), no
embedded Arrow schema, fluxmem's key-value metadata kept. The manifest's sizes and SHA-256s are
updated so the store stays consistent. Used by tests/cli.rs.

Usage: python rewrite_shards.py STORE
"""
import hashlib
import json
import os
import sys

import pyarrow.parquet as pq


def main(store):
    path = os.path.join(store, "manifest.json")
    manifest = json.load(open(path))
    for shard in manifest["shards"]:
        file = os.path.join(store, shard["file"])
        table = pq.read_table(file)
        metadata = pq.read_metadata(file).metadata or {}
        kept = {k: v for k, v in metadata.items() if not k.startswith(b"ARROW")}
        pq.write_table(table.replace_schema_metadata(kept), file)
        data = open(file, "rb").read()
        shard["bytes"] = len(data)
        shard["sha256"] = hashlib.sha256(data).hexdigest()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f)
    os.replace(tmp, path)
    print(f"ok: {len(manifest['shards'])} shards rewritten")


if __name__ == "__main__":
    main(sys.argv[1])
