#!/usr/bin/env python3
"""A synthetic agent fleet, deterministic per seed, in fluxmem's JSONL trajectory schema.

Task families each have a policy (facts) and a canonical tool sequence; an episode follows the
policy or deviates from it (skips or swaps a tool), and its outcome depends on that: following
succeeds 85% of the time, deviating 25%. Several tenants each have their own families and
facts. Episode `i` is the same whatever the batch it is written in, so night 2 (episodes
N..N+N/10) extends night 1 (0..N) exactly as one larger run would.

Usage:
  synth_fleet.py facts    --out FILE [--seed S] [--tenants T] [--families F] [--facts K]
  synth_fleet.py episodes --out FILE --from A --to B [--seed S] [--tenants T] [--families F] [--facts K]
"""
import argparse
import json
import random

VERBS = ["check", "verify", "look up", "update", "cancel", "refund", "rebook", "escalate", "confirm", "notify"]
OBJECTS = ["order", "invoice", "reservation", "account", "subscription", "shipment", "ticket", "payment", "profile", "warranty"]
QUALIFIERS = ["premium", "overdue", "international", "bulk", "flagged", "new", "enterprise", "partial", "duplicate", "expired"]
TOOLS = ["get_user", "get_order", "search_kb", "verify_identity", "update_record", "issue_refund", "send_email",
         "create_ticket", "check_inventory", "schedule_callback", "apply_discount", "close_case", "lookup_policy",
         "charge_card", "cancel_order", "rebook_flight"]


def family(tenant, f, seed):
    rng = random.Random(f"{seed}/family/{tenant}/{f}")
    verb, obj, qual = rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(QUALIFIERS)
    tools = rng.sample(TOOLS, rng.randint(4, 7))
    return {"name": f"{verb} a {qual} {obj}", "verb": verb, "object": obj, "qualifier": qual, "tools": tools}


def facts_of(tenant, t, args):
    per_tenant = args.facts // args.tenants
    out = []
    for k in range(per_tenant):
        fam = family(tenant, k % args.families, args.seed)
        rng = random.Random(f"{args.seed}/fact/{tenant}/{k}")
        tool = rng.choice(fam["tools"])
        limit = rng.choice([50, 100, 200, 500, 1000])
        text = (f"Policy {k} for {tenant}: when asked to {fam['name']}, call {tool} "
                f"{rng.choice(['before', 'after'])} any change; amounts over ${limit} need "
                f"{rng.choice(['a supervisor', 'identity verification', 'a second agent', 'written consent'])}.")
        out.append({"type": "fact", "tenant": tenant, "source": f"{tenant}-policy", "position": k,
                    "section": fam["name"], "text": text})
    return out


def episode(i, args):
    t = i % args.tenants
    tenant = f"tenant{t}"
    rng = random.Random(f"{args.seed}/episode/{i}")
    f = rng.randrange(args.families)
    fam = family(tenant, f, args.seed)
    follows = rng.random() < 0.7
    tools = list(fam["tools"])
    if not follows:
        if rng.random() < 0.5 and len(tools) > 2:
            del tools[rng.randrange(1, len(tools))]
        else:
            a, b = rng.sample(range(len(tools)), 2)
            tools[a], tools[b] = tools[b], tools[a]
    customer = f"C{rng.randrange(100000):05d}"
    amount = rng.choice([20, 80, 150, 250, 600, 1200])
    steps = []
    for s, tool in enumerate(tools):
        steps.append({
            "observation": (f"Customer {customer} asks to {fam['name']} worth ${amount}." if s == 0
                            else f"{tools[s - 1]} returned ok for {customer}."),
            "action": f"call {tool} for {fam['object']} of {customer}",
            "tool_calls": [{"name": tool, "arguments": {"customer": customer, "amount": amount}, "result": "ok"}],
        })
    success = rng.random() < (0.85 if follows else 0.25)
    return {
        "episode_id": f"synth-{i}",
        "tenant": tenant,
        "agent_id": f"agent{rng.randrange(8)}",
        "task": f"{fam['name'].capitalize()} for customer {customer} (${amount})",
        "started_at": 1_700_000_000_000 + i * 60_000,
        "steps": steps,
        "outcome": {"success": success},
        "metadata": {"task_id": f"family-{f}"},
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["facts", "episodes"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--from", dest="start", type=int, default=0)
    parser.add_argument("--to", dest="end", type=int, default=0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--tenants", type=int, default=2)
    parser.add_argument("--families", type=int, default=40)
    parser.add_argument("--facts", type=int, default=400)
    args = parser.parse_args()
    with open(args.out, "w") as out:
        if args.what == "facts":
            for t in range(args.tenants):
                for fact in facts_of(f"tenant{t}", t, args):
                    out.write(json.dumps(fact, sort_keys=True) + "\n")
        else:
            for i in range(args.start, args.end):
                out.write(json.dumps(episode(i, args), sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
