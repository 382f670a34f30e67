"""The agent's NVML readings beside nvidia-smi's, field by field (deploy/gpu/telemetry.sh).

    python3 deploy/gpu/telemetry_compare.py RESULTS_DIR

Reads {idle,load}-agent.jsonl (`trainyard-agent telemetry -o json`) and {idle,load}-smi.csv
(`nvidia-smi --query-gpu=$(head -1 smi-fields.txt) --format=csv,nounits -lms 1000`), pairs each
agent reading with nvidia-smi's nearest one of the same GPU (within PAIR_MS), and prints one row
per field and phase: both sides' mean, min and max, the median difference of the pairs and a
verdict against the field's tolerance. Writes compare.json beside the inputs. Exit 1 when any
field disagrees.
"""
import json
import statistics
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

PAIR_MS = 600
# agent field, nvidia-smi field, tolerance (absolute, or a fraction when below 1 and marked
# "rel"), what the tolerance stands for.
FIELDS = [
    ("clocks.sm_mhz", "clocks.sm", 30, "abs", "clocks move between two reads under load"),
    ("clocks.mem_mhz", "clocks.mem", 1, "abs", ""),
    ("clocks.max.sm_mhz", "clocks.max.sm", 0, "abs", ""),
    ("power.draw_w", "power.draw.average", 0.10, "rel", "NVML's power usage and smi's average"),
    ("power.draw_w", "power.draw", 0.10, "rel", ""),
    ("power.draw_w", "power.draw.instant", 0.25, "rel", "an instant reading under load swings"),
    ("power.limit_w", "enforced.power.limit", 0, "abs", ""),
    ("temperature.gpu_c", "temperature.gpu", 2, "abs", ""),
    ("temperature.memory_c", "temperature.memory", 2, "abs", ""),
    ("utilization.gpu_pct", "utilization.gpu", 10, "abs", "a sampled percentage"),
    ("memory.used_mib", "memory.used", 0.02, "rel", ""),
    ("clocks_event_reasons", "clocks_event_reasons.active", 0, "bits", "equal bit masks"),
    ("pcie.link.gen.current", "pcie.link.gen.current", 0, "abs", ""),
    ("pcie.link.gen.max", "pcie.link.gen.max", 0, "abs", ""),
    ("pcie.link.width.current", "pcie.link.width.current", 0, "abs", ""),
    ("pcie.link.width.max", "pcie.link.width.max", 0, "abs", ""),
    ("ecc.errors.corrected.volatile.total", "ecc.errors.corrected.volatile.total", 0, "abs", ""),
    ("ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.volatile.total", 0, "abs", ""),
    ("remapped_rows.pending", "remapped_rows.pending", 0, "abs", ""),
    ("remapped_rows.failure", "remapped_rows.failure", 0, "abs", ""),
]


def number(text):
    """nvidia-smi's cell as a number: hex masks, Yes/No, or None for N/A and [Not Supported]."""
    t = text.strip()
    if t.lower().startswith("0x"):
        return int(t, 16)
    if t in ("Yes", "No"):
        return 1 if t == "Yes" else 0
    try:
        return float(t)
    except ValueError:
        return None


def agent_value(row, field):
    v = row.get(field)
    if isinstance(v, bool):
        return 1 if v else 0
    if isinstance(v, str):
        return int(v, 16) if v.startswith("0x") else None
    return v


def read_smi(path, fields, zone):
    rows = []
    for line in path.read_text().splitlines()[1:]:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            continue
        row = dict(zip(fields, cells))
        try:
            at = datetime.strptime(row["timestamp"], "%Y/%m/%d %H:%M:%S.%f")
        except (KeyError, ValueError):
            continue
        at = at.replace(tzinfo=timezone(timedelta(hours=int(zone[:3]), minutes=int(zone[0] + zone[3:]))))
        row["at_ms"] = int(at.timestamp() * 1000)
        rows.append(row)
    return rows


def compare_phase(name, agent, smi):
    out = []
    for a_field, s_field, tol, kind, why in FIELDS:
        if not smi or s_field not in smi[0]:
            continue
        pairs, a_all, s_all = [], [], []
        for a in agent:
            av = agent_value(a, a_field)
            near = [s for s in smi if s.get("index") == str(a["gpu"])]
            if not near:
                continue
            s = min(near, key=lambda s: abs(s["at_ms"] - a["at_ms"]))
            sv = number(s[s_field])
            if av is not None:
                a_all.append(av)
            if sv is not None:
                s_all.append(sv)
            if av is not None and sv is not None and abs(s["at_ms"] - a["at_ms"]) <= PAIR_MS:
                pairs.append((av, sv))
        row = {"phase": name, "agent": a_field, "smi": s_field, "pairs": len(pairs), "note": why}
        stat = lambda xs: [round(statistics.mean(xs), 2), min(xs), max(xs)] if xs else None
        row["agent_mean_min_max"], row["smi_mean_min_max"] = stat(a_all), stat(s_all)
        if not a_all and not s_all:
            row["verdict"] = "neither reads it"
        elif not a_all or not s_all:
            row["verdict"] = "DISAGREE: only " + ("the agent" if a_all else "nvidia-smi") + " reads it"
        elif not pairs:
            row["verdict"] = "no pairs within %d ms" % PAIR_MS
        else:
            if kind == "bits":
                same = sum(1 for a, s in pairs if int(a) == int(s))
                row["median_diff"] = len(pairs) - same
                ok = same >= 0.8 * len(pairs)
                row["verdict"] = ("agree" if ok else "DISAGREE") + f" ({same}/{len(pairs)} equal)"
            else:
                diff = statistics.median(abs(a - s) for a, s in pairs)
                row["median_diff"] = round(diff, 3)
                limit = tol * max(statistics.mean(s_all), 1e-9) if kind == "rel" else tol
                row["verdict"] = "agree" if diff <= limit + 1e-9 else "DISAGREE"
        out.append(row)
    return out


def main():
    res = Path(sys.argv[1])
    lines = (res / "smi-fields.txt").read_text().splitlines()
    fields, zone = lines[0].split(","), lines[1].strip()
    rows = []
    for phase in ("idle", "load"):
        a_path, s_path = res / f"{phase}-agent.jsonl", res / f"{phase}-smi.csv"
        if not a_path.exists() or not s_path.exists():
            print(f"{phase}: no readings ({a_path.name} or {s_path.name} missing)")
            continue
        agent = [json.loads(l) for l in a_path.read_text().splitlines() if l.startswith("{")]
        rows += compare_phase(phase, agent, read_smi(s_path, fields, zone))
    fmt = "{:<5} {:<38} {:<36} {:>24} {:>24} {:>8} {:>5}  {}"
    print(fmt.format("phase", "agent field", "nvidia-smi field", "agent mean/min/max", "smi mean/min/max",
                     "med |d|", "pairs", "verdict"))
    show = lambda v: "-" if v is None else "/".join(f"{x:g}" for x in v)
    for r in rows:
        print(fmt.format(r["phase"], r["agent"], r["smi"], show(r["agent_mean_min_max"]),
                         show(r["smi_mean_min_max"]), r.get("median_diff", "-"), r["pairs"], r["verdict"]))
    (res / "compare.json").write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["verdict"].startswith("DISAGREE")]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} field comparisons agree; {len(bad)} disagree")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
