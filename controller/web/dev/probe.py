#!/usr/bin/env python3
"""Loads one page of the web view in headless Chromium in real time (no virtual time) and
reports how it went: body[data-ready], body[data-render-ms], console errors and uncaught
exceptions, failed requests. Talks to Chromium over --remote-debugging-pipe (the DevTools
protocol as NUL-terminated JSON on file descriptors 3 and 4), so it needs only the standard
library and the `chromium` binary.

    python3 controller/web/dev/probe.py http://127.0.0.1:8765/jobs/7 \
        [--screenshot /tmp/job7.png --size 1400,1000] [--zoom step_ms] [--eval 'JS expr']

--zoom METRIC drags across the middle fifth of plot-METRIC and waits for the zoomed series to
arrive, then double-clicks and waits for the full range again (checks the from/to requests).
Prints one JSON object; exits 1 when the page did not reach data-ready="1" or logged an error.
"""

from __future__ import annotations

import argparse
import base64
import json
import select
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--no-first-run", "--no-default-browser-check", "--disable-extensions",
    "--disable-background-networking", "--disable-sync", "--mute-audio", "--hide-scrollbars",
]


class Browser:
    def __init__(self, binary: str, size: tuple[int, int]):
        self.profile = tempfile.mkdtemp(prefix="trainyard-probe-")
        to_child_r, self.to_child = os.pipe()
        self.from_child, from_child_w = os.pipe()
        # The child reads commands on fd 3 and writes replies on fd 4.
        def setup():  # runs in the child before exec; 3 and 4 may be taken by the pipes themselves
            r, w = os.dup(to_child_r), os.dup(from_child_w)
            os.dup2(r, 3)
            os.dup2(w, 4)
        self.proc = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
             f"--window-size={size[0]},{size[1]}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4), preexec_fn=setup)
        os.close(to_child_r)
        os.close(from_child_w)
        self.buf = b""
        self.next_id = 0
        self.events: list[dict] = []
        self.session = None

    def close(self):
        try:
            self.send("Browser.close", session=False, wait=False)
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self.buf:
            if time.time() > deadline:
                raise TimeoutError("no message from chromium")
            r, _, _ = select.select([self.from_child], [], [], max(0.0, deadline - time.time()))
            if not r:
                continue
            chunk = os.read(self.from_child, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, session=True, wait=True, timeout=30.0):
        self.next_id += 1
        mid = self.next_id
        msg = {"id": mid, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.to_child, json.dumps(msg).encode() + b"\0")
        if not wait:
            return None
        deadline = time.time() + timeout
        while True:
            m = self._read_message(deadline)
            if m.get("id") == mid:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def pump(self, seconds: float):
        """Collects events for a while."""
        deadline = time.time() + seconds
        try:
            while True:
                self.events.append(self._read_message(deadline))
        except TimeoutError:
            pass

    def eval(self, expr: str):
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"eval {expr!r}: {r['exceptionDetails'].get('text')}")
        return r.get("result", {}).get("value")


def wait_for(b: Browser, expr: str, timeout: float, interval=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            v = b.eval(expr)
        except RuntimeError:  # between documents, or before <body> exists
            v = None
        if v:
            return v
        b.pump(interval)
    return None


def drag_zoom(b: Browser, metric: str, timeout: float) -> dict:
    sel = json.dumps(f"#plot-{metric} .u-over")
    info_sel = json.dumps(f"#plot-{metric} .plot-info")
    box = b.eval(f"(() => {{ const r = document.querySelector({sel}).getBoundingClientRect();"
                 f" return [r.left, r.top, r.width, r.height]; }})()")
    b.eval(f"document.querySelector({sel}).scrollIntoView({{block: 'center'}})")
    box = b.eval(f"(() => {{ const r = document.querySelector({sel}).getBoundingClientRect();"
                 f" return [r.left, r.top, r.width, r.height]; }})()")
    left, top, width, height = box
    y = top + height / 2
    x1, x2 = left + width * 0.4, left + width * 0.6
    before = b.eval(f"document.querySelector({info_sel}).textContent")
    t0 = time.time()
    b.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x1, "y": y})
    b.send("Input.dispatchMouseEvent", {"type": "mousePressed", "x": x1, "y": y, "button": "left", "clickCount": 1})
    for i in range(1, 11):
        b.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x1 + (x2 - x1) * i / 10, "y": y, "button": "left", "buttons": 1})
    b.send("Input.dispatchMouseEvent", {"type": "mouseReleased", "x": x2, "y": y, "button": "left", "clickCount": 1})
    zoomed = wait_for(b, f"(() => {{ const t = document.querySelector({info_sel}).textContent;"
                         f" return t !== {json.dumps(before)} ? t : null; }})()", timeout)
    zoom_ms = round((time.time() - t0) * 1000)
    t1 = time.time()
    b.eval(f"document.querySelector({sel}).dispatchEvent(new MouseEvent('dblclick', {{bubbles: true}}))")
    reset = wait_for(b, f"(() => {{ const t = document.querySelector({info_sel}).textContent;"
                        f" return t === {json.dumps(before)} ? t : null; }})()", timeout)
    return {"before": before, "zoomed": zoomed, "zoom_ms": zoom_ms, "reset": reset,
            "reset_ms": round((time.time() - t1) * 1000), "ok": bool(zoomed and reset)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser") or "chromium")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for data-ready")
    p.add_argument("--size", default="1400,1000")
    p.add_argument("--screenshot", help="PNG path, taken once the page is ready")
    p.add_argument("--zoom", metavar="METRIC", help="drag-zoom plot-METRIC, then double-click to reset")
    p.add_argument("--eval", action="append", default=[], help="JS expression to evaluate once ready")
    p.add_argument("--token", help="put this token in localStorage['trainyard.token'] first")
    p.add_argument("--settle", type=float, default=0.5, help="seconds to keep listening after ready")
    args = p.parse_args()
    size = tuple(int(x) for x in args.size.split(","))

    b = Browser(args.chromium, size)
    out: dict = {"url": args.url}
    try:
        targets = b.send("Target.getTargets", session=False)["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        b.session = b.send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True}, session=False)["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            b.send(f"{domain}.enable")
        if args.token:
            origin = "/".join(args.url.split("/")[:3])
            b.send("Page.navigate", {"url": origin + "/assets/style.css"})
            b.pump(0.5)
            b.eval(f"localStorage.setItem('trainyard.token', {json.dumps(args.token)})")
        t0 = time.time()
        b.send("Page.navigate", {"url": args.url})
        ready = wait_for(b, "document.body && document.body.dataset.ready", args.timeout, interval=0.02)
        out["wall_ms"] = round((time.time() - t0) * 1000)
        out["ready"] = ready
        out["render_ms"] = b.eval("document.body.dataset.renderMs ? Number(document.body.dataset.renderMs) : null")
        out["canvases"] = b.eval("document.querySelectorAll('.plot canvas').length")
        out["error_box"] = b.eval("(e => e && !e.hidden ? e.textContent : null)(document.getElementById('error'))")
        if args.zoom and ready == "1":
            out["zoom"] = drag_zoom(b, args.zoom, args.timeout)
        for expr in args.eval:
            out.setdefault("eval", {})[expr] = b.eval(expr)
        b.pump(args.settle)
        if args.screenshot:
            shot = b.send("Page.captureScreenshot", {"format": "png"})
            with open(args.screenshot, "wb") as f:
                f.write(base64.b64decode(shot["data"]))
            out["screenshot"] = args.screenshot
    finally:
        errors = []
        failed = []
        for e in b.events:
            m, prm = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = prm["exceptionDetails"]
                errors.append("exception: " + (d.get("exception", {}).get("description") or d.get("text", "")))
            elif m == "Runtime.consoleAPICalled" and prm.get("type") in ("error", "warning", "assert"):
                errors.append(f"console.{prm['type']}: " + " ".join(str(a.get("value", a.get("description", ""))) for a in prm.get("args", [])))
            elif m == "Log.entryAdded" and prm["entry"].get("level") in ("error", "warning"):
                errors.append(f"log.{prm['entry']['level']}: {prm['entry'].get('text')} {prm['entry'].get('url', '')}".strip())
            elif m == "Network.responseReceived" and prm["response"]["status"] >= 400:
                failed.append(f"{prm['response']['status']} {prm['response']['url']}")
        out["errors"] = errors
        out["failed_requests"] = failed
        b.close()
    print(json.dumps(out, indent=2))
    ok = out.get("ready") == "1" and not errors
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
