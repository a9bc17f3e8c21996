"""Scores exported skills against tau-bench gold actions (evaluation only: the gold
`info.task.actions` are read here to score, never by fluxmem).

Usage: python scripts/eval_skills.py STORE SKILLS_JSONL TAU_BENCH_JSON

Per task (its runs are the store's episodes with that `task_id`), the skill holding most of
the task's runs is the task's skill, and:
- coverage: the share of the task's runs that skill holds;
- tool recall: the share of the gold tools the skill names;
- order: LCS of the gold tool sequence and the skill's tool sequence over the gold length;
- precision: the share of the skill's named tools that the task's successful runs used.
Prints one line per task and the means (the issue's targets: 0.8, 0.8, 0.7, 0.7); recall and
order are averaged over the tasks with gold actions, precision over the tasks with a
successful run (undefined otherwise, and printed as `-`).
Needs pyarrow (the test .venv has it).
"""
import json
import os
import re
import sys

import pyarrow.parquet as pq


def live_rows(store, table):
    manifest = json.load(open(os.path.join(store, "manifest.json")))
    rows = {}
    for shard in sorted((s for s in manifest["shards"] if s["table"] == table), key=lambda s: s["commit"]):
        for row in pq.read_table(os.path.join(store, shard["file"])).to_pylist():
            rows[row["id"] if table == "nodes" else (row["episode_id"], row["step_index"])] = row
    return rows


def lcs(a, b):
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) - 1, -1, -1):
        for j in range(len(b) - 1, -1, -1):
            table[i][j] = table[i + 1][j + 1] + 1 if a[i] == b[j] else max(table[i + 1][j], table[i][j + 1])
    return table[0][0]


def main(store, skills_jsonl, data):
    nodes = live_rows(store, "nodes")
    steps = live_rows(store, "steps")
    gold = {str(run["task_id"]): [a["name"] for a in run["info"]["task"]["actions"]] for run in json.load(open(data))}
    used = {}
    for (episode, _), step in steps.items():
        for call in json.loads(step["tool_calls"] or "[]"):
            used.setdefault(episode, set()).add(call["name"])
    runs = {}
    for node in nodes.values():
        task = json.loads(node["metadata"] or "{}").get("task_id") if node["kind"] == "episodic" else None
        if task is not None and str(task) in gold:
            runs.setdefault(str(task), []).append(node)
    skills = [json.loads(line) for line in open(skills_jsonl)]
    named = lambda skill: [t for s in skill["steps"] for t in re.findall(r"`([A-Za-z0-9_]+)`", s)]
    sums = {"coverage": [], "recall": [], "order": [], "precision": []}
    for task, episodes in sorted(runs.items(), key=lambda kv: int(kv[0])):
        ids = {e["id"] for e in episodes}
        skill = max(skills, key=lambda s: (len(ids & set(s["source_episodes"])), s["id"]))
        tools = named(skill)
        wins = [e for e in episodes if e["success"]]
        successful = set().union(*[used.get(e["id"], set()) for e in wins]) if wins else set()
        scores = {"coverage": len(ids & set(skill["source_episodes"])) / len(ids)}
        if gold[task]:
            scores["recall"] = len(set(gold[task]) & set(tools)) / len(set(gold[task]))
            scores["order"] = lcs(gold[task], tools) / len(gold[task])
        if wins:
            scores["precision"] = len([t for t in tools if t in successful]) / max(1, len(tools))
        for key, value in scores.items():
            sums[key].append(value)
        shown = "  ".join(f"{k} {scores[k]:.2f}" if k in scores else f"{k} -" for k in sums)
        print(f"task {task:>3}  {shown}  {skill['name']!r}  gold {gold[task]}  skill {tools}")
    means = "  ".join(f"{k} {sum(v) / len(v):.2f} (n={len(v)})" for k, v in sums.items())
    print(f"mean over {len(runs)} tasks: {means}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
