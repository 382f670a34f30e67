"""Tests of the bootstrap (python/bootstrap/sitecustomize.py) and the receipts it writes for a
script that does not call trainyard_receipts (`_auto`, `_worker`, `_loggers`).

Each case runs a small script in a fresh interpreter with a bootstrap directory laid out as the
agent lays it out (sitecustomize.py beside the package) first on PYTHONPATH, then reads the
receipts file. Cases that need torch are skipped without it.
"""

from __future__ import annotations

import compileall
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainyard_receipts import _loggers  # noqa: E402

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

needs_torch = unittest.skipUnless(HAVE_TORCH, "torch is not installed for this interpreter")


class Boot:
    """A bootstrap directory and a scratch directory for one test class."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="trainyard-boot-"))
        self.boot = self.tmp / "boot"
        self.boot.mkdir()
        shutil.copy(ROOT / "bootstrap" / "sitecustomize.py", self.boot / "sitecustomize.py")
        shutil.copytree(ROOT / "trainyard_receipts", self.boot / "trainyard_receipts",
                        ignore=shutil.ignore_patterns("__pycache__"))
        # As the agent does once per bootstrap (--bootstrap-python): hash-checked .pyc files, so
        # that a rank, which cannot write there, need not compile the source at every start.
        compileall.compile_dir(str(self.boot), quiet=2,
                               invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)

    def run(self, script: str, *, env: Optional[Dict[str, str]] = None, extra_path: str = "",
            expect_ok: bool = True) -> "Result":
        body = self.tmp / "script.py"
        body.write_text(textwrap.dedent(script))
        receipts = self.tmp / "receipts.jsonl"
        receipts.unlink(missing_ok=True)
        full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
        full.update(PYTHONPATH=os.pathsep.join(p for p in (str(self.boot), extra_path) if p),
                    TRAINYARD_RECEIPTS=str(receipts), RANK="0", PYTHONDONTWRITEBYTECODE="1")
        full.update(env or {})
        out = subprocess.run([sys.executable, str(body)], env=full, capture_output=True, text=True,
                             timeout=120, cwd=self.tmp)
        if expect_ok and out.returncode != 0:
            raise AssertionError(f"script failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        lines = receipts.read_text().splitlines() if receipts.exists() else []
        return Result([json.loads(line) for line in lines], out.stdout, out.stderr)

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class Result:
    def __init__(self, receipts: List[Dict[str, Any]], stdout: str, stderr: str) -> None:
        self.receipts, self.stdout, self.stderr = receipts, stdout, stderr

    def of(self, kind: str) -> List[Dict[str, Any]]:
        return [r for r in self.receipts if r["kind"] == kind]

    @property
    def steps(self) -> List[int]:
        return [r["step"] for r in self.of("step")]


LOOP = """
import torch
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def batch():
    return model(torch.randn(4, 8)).pow(2).mean()
"""


class WithBoot(unittest.TestCase):
    """A test class with its own bootstrap directory, `self.b`."""

    b: Boot

    @classmethod
    def setUpClass(cls) -> None:
        cls.b = Boot()

    @classmethod
    def tearDownClass(cls) -> None:
        cls.b.close()


class BootstrapStartUp(WithBoot):
    """What the bootstrap does before torch: chain, stay out of children, cost little."""

    def test_the_environments_own_sitecustomize_still_runs_and_one_that_raises_stops_nothing(self) -> None:
        site = self.b.tmp / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_RAN = True\n")
        r = self.b.run("import builtins\nprint(getattr(builtins, 'SITE_RAN', False))\n", extra_path=str(site))
        self.assertEqual(r.stdout.strip(), "True", r.stderr)
        (site / "sitecustomize.py").write_text("raise RuntimeError('broken site')\n")
        r = self.b.run("print('the script ran')\n", extra_path=str(site))
        self.assertEqual(r.stdout.strip(), "the script ran")
        self.assertIn("broken site", r.stderr)
        self.assertIn("the script goes on", r.stderr)

    @needs_torch
    def test_of_a_torchrun_inside_the_job_its_first_local_worker_writes(self) -> None:
        script = LOOP + "batch().backward(); opt.step()\n"
        nested = {"TRAINYARD_JOB_ID": "5", "TORCHELASTIC_RUN_ID": "their-own"}
        self.assertEqual(self.b.run(script, env={**nested, "LOCAL_RANK": "1", "RANK": "1"}).receipts, [])
        self.assertEqual(self.b.run(script, env={**nested, "LOCAL_RANK": "0"}).steps, [0])
        ours = {"TRAINYARD_JOB_ID": "5", "TORCHELASTIC_RUN_ID": "trainyard-job-5", "LOCAL_RANK": "1"}
        self.assertEqual(self.b.run(script, env=ours).steps, [0], "a trainyard rank of local rank 1")

    def test_a_script_without_torch_gets_no_receipt(self) -> None:
        r = self.b.run("import json\nprint('no torch here')\n")
        self.assertEqual(r.receipts, [])
        self.assertEqual(r.stderr, "")

    def import_costs(self, boot: Path, runs: int) -> List[int]:
        """Microseconds `-X importtime` gives the bootstrap's import, in fresh interpreters."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
        env.update(PYTHONPATH=str(boot), TRAINYARD_RECEIPTS=str(self.b.tmp / "r.jsonl"), RANK="0",
                   PYTHONDONTWRITEBYTECODE="1")  # as in a directory the rank cannot write
        costs = []
        for _ in range(runs):
            out = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=env,
                                 capture_output=True, text=True, timeout=60)
            line = next(l for l in out.stderr.splitlines() if re.search(r"\|\s*sitecustomize$", l.rstrip()))
            costs.append(int(line.split("|")[1]))  # cumulative microseconds
        return costs

    def test_its_import_costs_at_most_5_ms_and_the_compiled_bootstrap_a_third_of_the_source(self) -> None:
        pyc = list((self.b.boot / "__pycache__").glob("sitecustomize.*.pyc"))
        self.assertEqual(len(pyc), 1, "the bootstrap is compiled as the agent compiles it")
        source = self.b.tmp / "source-only"
        shutil.copytree(self.b.boot, source, ignore=shutil.ignore_patterns("__pycache__"))
        compiled, uncompiled = [], []
        for _ in range(7):  # alternating, so that a busy moment weighs on both
            compiled += self.import_costs(self.b.boot, 1)
            uncompiled += self.import_costs(source, 1)
        # Compiling the source costs a rank 2-5 ms of a quiet 2-core machine (the compiler's first
        # use, mostly); loading the .pyc about 0.5 ms.
        self.assertLessEqual(min(compiled), 5000, f"compiled bootstrap's import, us: {compiled}")
        self.assertLess(3 * min(compiled), min(uncompiled), f"compiled {compiled}, from source {uncompiled}")


@needs_torch
class StepsFromHooks(WithBoot):
    """One step receipt per training iteration, whatever the loop looks like."""

    def test_a_plain_loop_gets_launch_steps_and_exit_with_its_own_compute_time(self) -> None:
        r = self.b.run(LOOP + """
for step in range(6):
    batch().backward(); opt.step(); opt.zero_grad()
""", env={"TRAINYARD_BOOTSTRAP_HASH": "ab" * 32})
        self.assertEqual([x["kind"] for x in r.receipts], ["launch"] + ["step"] * 6 + ["exit"])
        self.assertEqual(r.steps, list(range(6)))
        launch = r.of("launch")[0]
        self.assertEqual(launch["bootstrap_hash"], "ab" * 32)
        self.assertTrue(launch["producer"].startswith("trainyard bootstrap"))
        self.assertEqual(launch["device"], "cpu")
        for s in r.of("step")[1:]:
            self.assertGreater(s["fwd_bwd_ms"], 0)
            self.assertGreaterEqual(s["step_time_ms"], s["fwd_bwd_ms"])
            self.assertEqual(s["sources"], {"step_time_ms": "cpu_clock", "fwd_bwd_ms": "cpu_clock"})
        self.assertEqual(r.of("exit")[0]["status"], "ok")
        self.assertEqual(r.of("exit")[0]["steps_written"], 6)

    def test_a_script_that_ends_while_the_receipts_are_opening_loses_nothing(self) -> None:
        # The bootstrap opens its receipts in its own thread at the first step it writes, reading
        # the code's revision with git meanwhile; on a loaded machine that takes a while. A
        # script ending then once lost every receipt without a word (an exit handler of the
        # receipts closed them before the bootstrap's own). A slow git makes the window certain.
        slow = self.b.tmp / "slow-git"
        slow.mkdir(exist_ok=True)
        git = slow / "git"
        git.write_text("#!/bin/sh\nsleep 0.5\nexit 128\n")
        git.chmod(0o755)
        r = self.b.run(LOOP + """
import time
for step in range(4):
    batch().backward(); opt.step(); opt.zero_grad()
    if step == 1:
        time.sleep(0.25)  # the bootstrap's tick writes step 0 and starts opening the receipts
""", env={"PATH": f"{slow}{os.pathsep}{os.environ.get('PATH', '')}"})
        self.assertEqual([x["kind"] for x in r.receipts], ["launch"] + ["step"] * 4 + ["exit"], r.stderr)
        self.assertEqual(r.steps, list(range(4)))
        self.assertEqual(r.of("exit")[0]["steps_written"], 4)

    def test_two_optimizers_accumulation_and_nesting_are_one_step_each_iteration(self) -> None:
        r = self.b.run(LOOP + """
head = torch.nn.Linear(8, 1)
opt2 = torch.optim.Adam(head.parameters(), lr=0.1)
class Outer(torch.optim.SGD):
    def step(self, closure=None):
        opt2.step()  # an inner optimizer stepped from inside another's step
        return super().step(closure)
outer = Outer(model.parameters(), lr=0.1)
for step in range(4):
    for micro in range(3):  # gradient accumulation
        (batch() + head(torch.randn(4, 8)).mean()).backward()
    outer.step(); opt.step(); outer.zero_grad(); opt2.zero_grad()
""")
        self.assertEqual(r.steps, [0, 1, 2, 3])

    def test_a_resumed_attempt_counts_on_from_its_resume_step(self) -> None:
        r = self.b.run(LOOP + """
for step in range(3):
    batch().backward(); opt.step(); opt.zero_grad()
""", env={"TRAINYARD_RESUME": "1", "TRAINYARD_RESUME_STEP": "40"})
        self.assertEqual(r.steps, [41, 42, 43])

    def test_a_skipped_gradscaler_step_is_a_step_flagged_skipped(self) -> None:
        r = self.b.run(LOOP + """
scaler = torch.amp.GradScaler("cpu")
for step in range(4):
    loss = batch()
    if step == 2:
        loss = loss * float("inf")
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()
""")
        self.assertEqual(r.steps, [0, 1, 2, 3])
        self.assertEqual([s.get("skipped", False) for s in r.of("step")], [False, False, True, False])

    def test_an_evaluation_and_a_checkpoint_flag_the_step_whose_time_holds_them(self) -> None:
        r = self.b.run(LOOP + """
import os
for step in range(4):
    batch().backward(); opt.step(); opt.zero_grad()
    if step == 1:
        model.eval(); model.train()
        torch.save(model.state_dict(), os.path.join(os.getcwd(), "ckpt.pt"))
""")
        self.assertEqual([s.get("contains", []) for s in r.of("step")], [[], [], ["checkpoint", "eval"], []])

    def test_the_helper_in_the_script_means_no_second_receipt(self) -> None:
        r = self.b.run(LOOP + """
import trainyard_receipts as ty
receipts = ty.start()
for step in range(3):
    with receipts.step_timer(step):
        batch().backward(); opt.step(); opt.zero_grad()
receipts.exit(2, "ok")
""")
        self.assertEqual(len(r.of("launch")), 1)
        self.assertEqual(r.steps, [0, 1, 2])
        self.assertNotIn("trainyard bootstrap", r.of("launch")[0]["producer"])

    def test_a_script_writing_its_own_receipt_lines_gets_none_of_ours(self) -> None:
        r = self.b.run(LOOP + """
import json, os
with open(os.environ["TRAINYARD_RECEIPTS"], "a") as f:
    f.write(json.dumps({"kind": "launch", "schema": 1, "by": "hand"}) + "\\n")
for step in range(3):
    with open(os.environ["TRAINYARD_RECEIPTS"], "a") as f:  # its own receipt, before the step ends
        f.write(json.dumps({"kind": "step", "schema": 1, "step": step, "step_time_ms": 1.0}) + "\\n")
    batch().backward(); opt.step(); opt.zero_grad()
""")
        self.assertEqual(r.steps, [0, 1, 2])
        self.assertTrue(all("sources" not in s for s in r.of("step")), r.receipts)

    def test_a_script_writing_records_of_other_kinds_still_gets_its_steps(self) -> None:
        r = self.b.run(LOOP + """
import json, os
with open(os.environ["TRAINYARD_RECEIPTS"], "a") as f:
    f.write(json.dumps({"kind": "my-config", "lr": 0.1}) + "\\n")
for step in range(3):
    batch().backward(); opt.step(); opt.zero_grad()
""")
        self.assertEqual(r.steps, [0, 1, 2])

    def test_children_of_the_rank_write_nothing(self) -> None:
        r = self.b.run(LOOP + """
import subprocess, sys
code = "import torch; m = torch.nn.Linear(2, 1); o = torch.optim.SGD(m.parameters(), lr=1)\\n" \\
       "m(torch.ones(1, 2)).sum().backward(); o.step()"
subprocess.run([sys.executable, "-c", code], check=True)
batch().backward(); opt.step()
""")
        self.assertEqual(r.steps, [0])
        self.assertEqual(len(r.of("launch")), 1)

    def test_an_uncaught_exception_is_a_failed_exit_and_the_script_still_reports_it(self) -> None:
        r = self.b.run(LOOP + """
batch().backward(); opt.step()
raise ValueError("bad batch")
""", expect_ok=False)
        self.assertIn("ValueError: bad batch", r.stderr)
        self.assertEqual(r.of("exit")[0]["status"], "failed")
        self.assertIn("bad batch", r.of("exit")[0]["reason"])

    def test_a_loop_faster_than_the_cap_has_steps_counted_not_written(self) -> None:
        r = self.b.run("""
import torch
p = torch.nn.Parameter(torch.zeros(1))
opt = torch.optim.SGD([p], lr=0.1)
for step in range(30000):
    opt.step()
""")
        exit_ = r.of("exit")[0]
        written, skipped = len(r.steps), exit_["steps_not_recorded"]
        self.assertEqual(written + skipped, 30000, exit_)
        self.assertLessEqual(written, 500 + 500 * 10, "a burst, then 500 a second")
        self.assertGreater(skipped, 0)
        later = [s for s in r.of("step") if "dropped_steps" in s]
        self.assertEqual(sum(s["dropped_steps"] for s in later), skipped - (30000 - 1 - r.steps[-1]))

    def test_auto_off_writes_nothing(self) -> None:
        r = self.b.run(LOOP + "batch().backward(); opt.step()\n", env={"TRAINYARD_RECEIPTS_AUTO": "0"})
        self.assertEqual(r.receipts, [])

    def test_values_logged_after_the_step_belong_to_it_and_before_to_the_next(self) -> None:
        after = self.b.run(LOOP + """
from torch.utils.tensorboard import SummaryWriter
w = SummaryWriter(".tb-after")
for step in range(3):
    loss = batch(); loss.backward(); opt.step(); opt.zero_grad()
    w.add_scalar("train/loss", float(step), step)
""")
        self.assertEqual([s.get("loss") for s in after.of("step")], [0.0, 1.0, 2.0])
        before = self.b.run(LOOP + """
from torch.utils.tensorboard import SummaryWriter
w = SummaryWriter(".tb-before")
for step in range(3):
    loss = batch(); loss.backward()
    w.add_scalar("train/loss", float(step), step)
    opt.step(); opt.zero_grad()
""")
        self.assertEqual([s.get("loss") for s in before.of("step")], [0.0, 1.0, 2.0])

    def test_torch_compile_keeps_its_graphs_and_the_hooks_still_fire(self) -> None:
        script = LOOP + """
import json
import torch._dynamo
from torch._dynamo.utils import counters
fwd = torch.compile(model, backend="eager")
@torch.compile(backend="eager")
def opt_step():
    opt.step()
graphs = []
for step in range(6):
    fwd(torch.randn(4, 8)).pow(2).mean().backward(); opt_step(); opt.zero_grad()
    graphs.append(counters["stats"]["unique_graphs"])
print(json.dumps({"breaks": sum(counters["graph_break"].values()), "graphs": graphs}))
"""
        base = json.loads(self.b.run(script, env={"TRAINYARD_RECEIPTS_AUTO": "0"}).stdout)
        r = self.b.run(script)
        ours = json.loads(r.stdout)
        self.assertEqual(r.steps, [0, 1, 2, 3, 4, 5], "the hooks fire in every compiled step")
        self.assertEqual(ours["graphs"], base["graphs"], "the same graphs, none compiled again")
        self.assertEqual(ours["graphs"][1], ours["graphs"][-1], "no recompile after the first steps")
        self.assertLessEqual(ours["breaks"], base["breaks"], f"no new graph break: {ours} vs {base}")


class Names(unittest.TestCase):
    def test_logged_names_map_onto_schema_v1_and_the_rest_keep_their_own(self) -> None:
        mapped, own = _loggers.schema_fields(
            {"train/loss": 2.5, "learning_rate": 1e-4, "lr-AdamW": 2e-4, "bf16_mfu": 41.0,
             "tok/sec": 1234, "epoch": 1, "step": 7, "image": object(), "nan": float("nan")},
            {"train/loss": "wandb"})
        self.assertEqual(mapped["loss"], (2.5, "wandb"))
        self.assertEqual(mapped["lr"][0], 1e-4, "the plain name wins over Lightning's lr-AdamW")
        self.assertAlmostEqual(mapped["mfu"][0], 0.41)
        self.assertEqual(mapped["tokens_per_s"][0], 1234.0)
        self.assertEqual(own, {"epoch": 1.0, "logged.step": 7.0})


if __name__ == "__main__":
    unittest.main()
