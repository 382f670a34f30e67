"""Tests of trainyard_receipts (standard library unittest; torch optional).

    python -m unittest discover -s python/tests -v
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path
from typing import Any, Dict, List
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainyard_receipts as ty  # noqa: E402
from trainyard_receipts import _provenance, _receipts, _writer  # noqa: E402

H100_SXM = "NVIDIA H100 80GB HBM3"

# The typed fields of a v1 step receipt and their JSON types (docs/receipts.md).
STEP_TYPES = {
    "step": int,
    "step_time_ms": (int, float),
    "fwd_bwd_ms": (int, float),
    "optimizer_ms": (int, float),
    "tokens_per_s": (int, float),
    "mfu": (int, float),
    "loss": (int, float),
    "mem_allocated_bytes": int,
    "mem_reserved_bytes": int,
    "mem_peak_allocated_bytes": int,
}


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def read_receipts(path: Path) -> List[Dict[str, Any]]:
    """Every line of a receipts file as a strict JSON object (NaN and Infinity rejected)."""
    receipts = []
    with open(path, "rb") as f:
        for raw in f:
            assert raw.endswith(b"\n"), f"a line without its newline: {raw!r}"
            value = json.loads(raw, parse_constant=_reject_constant)
            assert isinstance(value, dict), f"not a JSON object: {raw!r}"
            receipts.append(value)
    return receipts


class ReceiptsTestCase(unittest.TestCase):
    """A temporary directory and an environment without the launcher's variables."""

    def setUp(self) -> None:
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        for name in list(os.environ):
            if name.startswith("TRAINYARD_") or name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
                del os.environ[name]
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.dir = Path(tmp.name)
        self.path = self.dir / "receipts.jsonl"

    def start(self, **kwargs: Any) -> ty.Receipts:
        receipts = ty.start(path=str(self.path), **kwargs)
        self.addCleanup(receipts.close)
        return receipts

    def written(self, receipts: ty.Receipts) -> List[Dict[str, Any]]:
        receipts.close()
        return read_receipts(self.path)


class SchemaTest(ReceiptsTestCase):
    def test_every_line_is_a_v1_receipt(self) -> None:
        r = self.start(model_flops_per_token=6e9, tokens_per_step=4096, device_name=H100_SXM)
        r.step(0, step_time_ms=812.5, loss=3.25, fwd_bwd_ms=700.0, optimizer_ms=100.0, lr=0.02)
        r.eval(0, val_loss=3.5, duration_ms=12.5)
        r.checkpoint(0, self.dir / "ckpt", size_bytes=123, duration_ms=45.0)
        r.emit("goodput", wall_ms=1000.0, goodput=0.8)
        r.exit(0, "ok", "completed")
        receipts = self.written(r)
        self.assertEqual(
            [x["kind"] for x in receipts], ["launch", "step", "eval", "checkpoint", "goodput", "exit"]
        )
        for receipt in receipts:
            self.assertEqual(receipt["schema"], 1)
            self.assertIsInstance(receipt["created_at_ms"], int)
        step = receipts[1]
        for name, types in STEP_TYPES.items():
            if name in step:
                self.assertIsInstance(step[name], types, name)
                self.assertNotIsInstance(step[name], bool, name)
        self.assertEqual((step["step"], step["step_time_ms"], step["loss"]), (0, 812.5, 3.25))
        self.assertEqual((step["fwd_bwd_ms"], step["optimizer_ms"], step["lr"]), (700.0, 100.0, 0.02))
        self.assertLessEqual(step["mfu"], 1.0)
        self.assertEqual(receipts[2], {**receipts[2], "step": 0, "val_loss": 3.5, "duration_ms": 12.5})
        checkpoint = receipts[3]
        self.assertEqual(
            (checkpoint["path"], checkpoint["bytes"], checkpoint["duration_ms"]),
            (str(self.dir / "ckpt"), 123, 45.0),
        )
        exit_ = receipts[5]
        self.assertEqual((exit_["step"], exit_["status"], exit_["reason"]), (0, "ok", "completed"))
        self.assertEqual((exit_["dropped_receipts_total"], exit_["nulled_values"]), (0, 0))
        launch = receipts[0]
        for name in ("torch", "cuda", "nccl", "driver", "python", "hostname", "pid", "rank",
                     "local_rank", "world_size", "gpu_uuid", "device", "source_rev",
                     "source_dirty", "env", "mfu_peak_flops"):
            self.assertIn(name, launch)
        self.assertEqual((launch["rank"], launch["world_size"], launch["pid"]), (0, 1, os.getpid()))

    def test_invalid_arguments_fail_at_once(self) -> None:
        r = self.start()
        with self.assertRaises(ValueError):
            r.step(-1, step_time_ms=1.0)
        with self.assertRaises(TypeError):
            r.step(1.5, step_time_ms=1.0)  # type: ignore[arg-type]
        with self.assertRaises(ValueError):
            r.exit(0, "crashed")

    def test_a_field_cannot_replace_kind_or_schema(self) -> None:
        r = self.start()
        r.emit("note", schema=7, text="hello")
        r.step(0, step_time_ms=1.0, kind="other", schema=2)
        _, note, step = self.written(r)
        self.assertEqual((note["kind"], note["schema"], note["text"]), ("note", 1, "hello"))
        self.assertEqual((step["kind"], step["schema"]), ("step", 1))


class ThroughputTest(ReceiptsTestCase):
    def test_tokens_per_s_and_mfu_of_a_known_sku(self) -> None:
        # 2 ranks of 8 x 2,048 tokens each; 6 x 124M parameters per token; 700 ms a step.
        flops_per_token = 6 * 124e6
        r = self.start(
            model_flops_per_token=flops_per_token,
            tokens_per_step=8 * 2048,
            world_size=2,
            device_name=H100_SXM,
        )
        r.step(5, step_time_ms=700.0)
        launch, step = self.written(r)
        self.assertEqual((launch["mfu_sku"], launch["mfu_peak_flops"]), ("H100 SXM", 989e12))
        self.assertIsNone(launch["mfu_unavailable"])
        self.assertEqual(step["tokens"], 2 * 8 * 2048)
        self.assertAlmostEqual(step["tokens_per_s"], 2 * 8 * 2048 / 0.7)
        self.assertAlmostEqual(step["mfu"], flops_per_token * 8 * 2048 / 0.7 / 989e12, places=12)
        self.assertAlmostEqual(step["mfu"], 0.0176075, places=6)

    def test_tokens_given_for_one_step_override_tokens_per_step(self) -> None:
        r = self.start(model_flops_per_token=1e9, tokens_per_step=1000, world_size=4,
                       device_name="NVIDIA A100-SXM4-80GB")
        r.step(0, step_time_ms=1000.0, tokens=500)
        step = self.written(r)[1]
        self.assertEqual((step["tokens"], step["tokens_per_s"]), (2000, 2000.0))
        self.assertAlmostEqual(step["mfu"], 1e9 * 500 / 312e12)

    def test_an_explicit_peak_serves_a_gpu_the_table_lacks(self) -> None:
        r = self.start(model_flops_per_token=1e9, tokens_per_step=100, device_name="NVIDIA L4",
                       peak_flops=121e12)
        r.step(0, step_time_ms=100.0)
        launch, step = self.written(r)
        self.assertEqual((launch["mfu_sku"], launch["mfu_peak_flops"]), ("given", 121e12))
        self.assertAlmostEqual(step["mfu"], 1e9 * 100 / 0.1 / 121e12)

    def test_unknown_sku_or_no_gpu_means_no_mfu(self) -> None:
        for device_name, reason in (("NVIDIA L4", "'NVIDIA L4'"), (None, None)):
            with self.subTest(device_name=device_name):
                self.path.unlink(missing_ok=True)
                r = self.start(model_flops_per_token=1e9, tokens_per_step=100,
                               device_name=device_name)
                r.step(0, step_time_ms=100.0)
                launch, step = self.written(r)
                self.assertIsNone(launch["mfu_peak_flops"])
                self.assertIsNone(launch["mfu_sku"])
                if reason is not None:
                    self.assertIn(reason, launch["mfu_unavailable"])
                elif launch["device"] in (None, "cpu"):
                    self.assertEqual(launch["mfu_unavailable"], "no CUDA device")
                self.assertNotIn("mfu", step)
                self.assertEqual(step["tokens_per_s"], 1000.0)

    def test_an_mfu_above_one_is_kept_out_of_mfu(self) -> None:
        r = self.start(model_flops_per_token=1e15, tokens_per_step=1000, device_name=H100_SXM)
        with contextlib.redirect_stderr(io.StringIO()) as err:
            r.step(0, step_time_ms=1.0)
        step = self.written(r)[1]
        self.assertNotIn("mfu", step)
        self.assertGreater(step["mfu_above_peak"], 1.0)
        self.assertIn("above 1", err.getvalue())

    def test_dense_bf16_peaks(self) -> None:
        cases = {
            "NVIDIA H100 80GB HBM3": ("H100 SXM", 989e12),
            "NVIDIA H100 NVL": ("H100 NVL", 835e12),
            "NVIDIA H100 PCIe": ("H100 PCIe", 756e12),
            "NVIDIA H200": ("H200 SXM", 989e12),
            "NVIDIA H200 NVL": ("H200 NVL", 835e12),
            "NVIDIA A100-SXM4-80GB": ("A100", 312e12),
            "NVIDIA A100 80GB PCIe": ("A100", 312e12),
            "NVIDIA L40S": ("L40S", 362e12),
            "NVIDIA B200": ("B200", 2250e12),
        }
        for name, expected in cases.items():
            self.assertEqual(tuple(ty.dense_bf16_peak(name) or ()), expected, name)
        for name in ("NVIDIA RTX A1000", "NVIDIA L4", "NVIDIA GeForce RTX 4090", "cpu", ""):
            self.assertIsNone(ty.dense_bf16_peak(name), name)


class NonFiniteTest(ReceiptsTestCase):
    def test_nan_and_infinity_are_written_as_null_and_counted(self) -> None:
        r = self.start(tokens_per_step=100)
        r.step(0, step_time_ms=10.0, loss=float("nan"), grad_norm=math.inf,
               extra={"values": [1.0, -math.inf]})
        r.step(1, step_time_ms=-3.0, loss=2.0, optimizer_ms=-1)
        r.exit()
        _, first, second, exit_ = self.written(r)
        self.assertIsNone(first["loss"])
        self.assertIsNone(first["grad_norm"])
        self.assertEqual(first["extra"], {"values": [1.0, None]})
        self.assertEqual(first["nulled_fields"], ["loss", "grad_norm", "extra.values[1]"])
        self.assertEqual(first["tokens_per_s"], 10_000.0)
        # Negative times: null (and no throughput from a negative step time).
        self.assertIsNone(second["step_time_ms"])
        self.assertIsNone(second["optimizer_ms"])
        self.assertNotIn("tokens_per_s", second)
        self.assertEqual(second["loss"], 2.0)
        self.assertEqual(exit_["nulled_values"], 5)
        self.assertEqual(exit_["step"], 1, "the exit receipt defaults to the last step")


class NeverBlocksTest(ReceiptsTestCase):
    def stalled(self, **kwargs: Any) -> ty.Receipts:
        """Receipts whose writer is stuck opening the file (a file system that does not
        answer) until `self.release` is set."""
        self.release = threading.Event()
        real_open = _writer._open_append

        def stuck_open(path: str) -> int:
            self.release.wait(30)
            return real_open(path)

        with mock.patch.object(_writer, "_open_append", stuck_open):
            receipts = self.start(**kwargs)
        thread = receipts._writer._thread

        def unstick() -> None:
            self.release.set()
            thread.join(10)  # done with the directory before it is removed

        self.addCleanup(unstick)
        return receipts

    def test_a_stalled_writer_drops_and_counts_without_blocking(self) -> None:
        r = self.stalled(tokens_per_step=10, capacity=50)
        accepted = dropped = 0
        slowest = 0.0
        for step in range(2000):
            began = time.perf_counter()
            queued = r.step(step, step_time_ms=1.0, loss=1.0)
            slowest = max(slowest, time.perf_counter() - began)
            accepted += queued
            dropped += not queued
        self.assertLess(slowest, 0.5, "step() waited for the stalled writer")
        self.assertEqual(accepted, 49, "the launch receipt and 49 steps fill a queue of 50")
        self.assertEqual((dropped, r.dropped), (1951, 1951))
        self.release.set()
        deadline = time.monotonic() + 10
        while not r.step(2000, step_time_ms=1.0) and time.monotonic() < deadline:
            time.sleep(0.01)
        r.exit(2000)
        receipts = self.written(r)
        steps = [x for x in receipts if x["kind"] == "step"]
        self.assertEqual(len(steps), 50)
        self.assertNotIn("dropped_receipts", steps[0])
        late = steps[-1]
        self.assertEqual(late["step"], 2000)
        self.assertEqual(late["dropped_receipts"], r.dropped, "drops reported by the next one through")
        self.assertGreaterEqual(r.dropped, 1951)
        self.assertEqual(receipts[-1]["kind"], "exit")
        self.assertEqual(receipts[-1]["dropped_receipts_total"], r.dropped)

    def test_close_gives_up_after_its_timeout(self) -> None:
        r = self.stalled()
        r.step(0, step_time_ms=1.0)
        began = time.monotonic()
        with contextlib.redirect_stderr(io.StringIO()) as err:
            r.close(timeout=0.2)
        self.assertLess(time.monotonic() - began, 2.0)
        self.assertIn("2 receipts not written", err.getvalue())
        self.assertFalse(r.step(1, step_time_ms=1.0), "nothing is queued after close()")


class StepTimerTest(ReceiptsTestCase):
    def test_the_timer_measures_the_step_and_its_phases(self) -> None:
        r = self.start(tokens_per_step=100)
        with r.step_timer(0) as s:
            with s.phase("fwd_bwd"):
                time.sleep(0.03)
            with s.phase("optimizer"):
                time.sleep(0.01)
            s.loss = 1.5
            s.update(lr=0.1)
        with self.assertRaises(RuntimeError):
            with r.step_timer(1):
                raise RuntimeError("a step cut short")
        _, step = self.written(r)
        self.assertEqual((step["step"], step["loss"], step["lr"]), (0, 1.5, 0.1))
        self.assertGreaterEqual(step["fwd_bwd_ms"], 30.0)
        self.assertGreaterEqual(step["optimizer_ms"], 10.0)
        self.assertGreaterEqual(step["step_time_ms"], step["fwd_bwd_ms"] + step["optimizer_ms"])
        self.assertAlmostEqual(step["step_time_ms"], s.step_time_ms)
        self.assertAlmostEqual(step["tokens_per_s"], 100 / (step["step_time_ms"] / 1000))

    def test_as_a_context_manager_it_writes_the_exit_receipt(self) -> None:
        with self.assertRaises(KeyError):
            with self.start() as r:
                r.step(3, step_time_ms=1.0)
                raise KeyError("boom")
        exit_ = read_receipts(self.path)[-1]
        self.assertEqual((exit_["kind"], exit_["status"], exit_["step"]), ("exit", "failed", 3))
        self.assertIn("KeyError", exit_["reason"])


class LaunchTest(ReceiptsTestCase):
    def test_the_env_overlay_is_recorded_as_the_process_sees_it(self) -> None:
        os.environ.update(
            TRAINYARD_ENV_OVERLAY="NCCL_DEBUG,TRAINYARD_DEMO_FLAG,GONE",
            NCCL_DEBUG="WARN",
            TRAINYARD_DEMO_FLAG="1",
            NOT_IN_THE_OVERLAY="x",
        )
        launch = self.written(self.start())[0]
        self.assertEqual(launch["env"], {"GONE": None, "NCCL_DEBUG": "WARN", "TRAINYARD_DEMO_FLAG": "1"})

    def test_no_overlay_outside_trainyard(self) -> None:
        self.assertIsNone(self.written(self.start())[0]["env"])
        os.environ["TRAINYARD_ENV_OVERLAY"] = ""
        self.path.unlink()
        self.assertEqual(self.written(self.start())[0]["env"], {})

    def test_rank_variables_and_gpu(self) -> None:
        os.environ.update(
            RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", TRAINYARD_GPU="5",
            TRAINYARD_GPU_UUID="GPU-abc", TRAINYARD_GPU_PCI_BUS_ID="00000000:18:00.0",
        )
        launch = self.written(self.start())[0]
        self.assertEqual(
            (launch["rank"], launch["local_rank"], launch["world_size"]), (3, 1, 4)
        )
        self.assertEqual(
            (launch["gpu"], launch["gpu_uuid"], launch["gpu_pci_bus_id"]),
            ("5", "GPU-abc", "00000000:18:00.0"),
        )

    def test_git_revision_of_the_source_dir(self) -> None:
        if shutil.which("git") is None:
            self.skipTest("skipped: git not installed")
        repo = self.dir / "src"
        repo.mkdir()
        git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
        subprocess.run([*git, "init", "-q"], check=True)
        (repo / "train.py").write_text("print('hi')\n")
        subprocess.run([*git, "add", "train.py"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
        head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
        os.environ["TRAINYARD_SOURCE_DIR"] = str(repo)
        launch = self.written(self.start())[0]
        self.assertEqual((launch["source_rev"], launch["source_dirty"]), (head, False))
        self.assertEqual(launch["source_dir"], str(repo))
        (repo / "train.py").write_text("print('changed')\n")
        self.path.unlink()
        launch = self.written(self.start())[0]
        self.assertEqual((launch["source_rev"], launch["source_dirty"]), (head, True))
        os.environ["TRAINYARD_SOURCE_DIR"] = str(self.dir / "not-a-repo")
        (self.dir / "not-a-repo").mkdir()
        self.path.unlink()
        launch = self.written(self.start())[0]
        self.assertEqual((launch["source_rev"], launch["source_dirty"]), (None, None))

    def test_versions_are_read_from_the_loaded_torch(self) -> None:
        try:
            import torch
        except ImportError:
            torch = None
        launch = self.written(self.start())[0]
        if torch is None:
            self.assertEqual((launch["torch"], launch["cuda"], launch["nccl"]), (None, None, None))
            self.assertIsNone(launch["device"])
        else:
            self.assertEqual(launch["torch"], torch.__version__)
            self.assertEqual(launch["cuda"], torch.version.cuda)
            if not torch.cuda.is_available():
                self.assertEqual(launch["device"], "cpu")
        self.assertEqual(launch["python"], ".".join(map(str, sys.version_info[:3])))

    def test_version_strings(self) -> None:
        self.assertEqual(_provenance.nccl_version_string((2, 28, 9)), "2.28.9")
        self.assertEqual(_provenance.nccl_version_string((2, 28, 9, "a0")), "2.28.9+a0")
        self.assertEqual(_provenance.nccl_version_string(22809), "2.28.9")
        self.assertEqual(_provenance.nccl_version_string(2708), "2.7.8")
        self.assertIsNone(_provenance.nccl_version_string("weird"))
        proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024"
        open_module = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  "
                       "Release Build  (dvs-builder@U16-I3-B03-4-3)  Thu Jan 23 22:54:49 UTC 2025")
        self.assertEqual(_provenance.parse_driver_version(proprietary), "550.54.15")
        self.assertEqual(_provenance.parse_driver_version(open_module), "570.86.15")
        self.assertIsNone(_provenance.parse_driver_version("something else"))
        self.assertIsNone(_provenance.driver_version(str(self.dir / "missing")))


class PathTest(ReceiptsTestCase):
    def test_rank_template_for_plain_torchrun(self) -> None:
        os.environ.update(RANK="3", TRAINYARD_RECEIPTS=str(self.dir / "receipts-{rank}.jsonl"))
        r = ty.start()
        r.close()
        self.assertEqual(read_receipts(self.dir / "receipts-3.jsonl")[0]["rank"], 3)

    def test_without_a_path_nothing_is_written_and_it_says_so_once(self) -> None:
        with mock.patch.object(_receipts, "_warned_disabled", False):
            with contextlib.redirect_stderr(io.StringIO()) as err:
                first, second = ty.start(), ty.start()
        self.assertFalse(first.enabled)
        self.assertFalse(first.step(0, step_time_ms=1.0, loss=1.0))
        self.assertFalse(second.exit(0))
        self.assertEqual(err.getvalue().count("TRAINYARD_RECEIPTS is not set"), 1, err.getvalue())
        self.assertEqual(list(self.dir.iterdir()), [])


if __name__ == "__main__":
    unittest.main()


class CheckpointRequestTest(ReceiptsTestCase):
    """should_checkpoint() answers each request of trainyard's once; resume_point() reads where
    a restarted attempt continues."""

    def test_each_request_is_answered_once(self) -> None:
        request = self.dir / "checkpoint.request"
        os.environ["TRAINYARD_CHECKPOINT_REQUEST"] = str(request)
        r = self.start()
        self.assertFalse(r.should_checkpoint(), "no request yet")
        request.write_text("1 drain\n")
        self.assertTrue(r.should_checkpoint())
        self.assertFalse(r.should_checkpoint(), "the same request is answered once")
        later = time.time() + 5
        request.write_text("2 preemption\n")
        os.utime(request, (later, later))
        self.assertTrue(r.should_checkpoint(), "a new request is answered again")

    def test_resume_point_only_when_resuming(self) -> None:
        self.assertIsNone(ty.Receipts.resume_point())
        os.environ.update({"TRAINYARD_RESUME": "1", "TRAINYARD_RESUME_STEP": "1200", "TRAINYARD_RESUME_PATH": "/ck/1200"})
        self.assertEqual(ty.Receipts.resume_point(), (1200, "/ck/1200"))
        os.environ["TRAINYARD_RESUME_STEP"] = ""
        self.assertIsNone(ty.Receipts.resume_point(), "resuming, but no checkpoint is complete")
