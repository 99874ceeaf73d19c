"""Shared by the `kiln serve` checks: start a server on a free loopback port, talk JSON to it."""
import json, os, shutil, subprocess, sys, time, urllib.error, urllib.request


def start_server(kiln, work, name, extra=()):
    """Starts `kiln serve --port 0` (the kernel picks a free port) and waits until it listens.
    Returns (process, base URL). Its stderr goes to WORK/NAME.log."""
    port_file = f"{work}/{name}.port"
    if os.path.exists(port_file):
        os.remove(port_file)
    log = open(f"{work}/{name}.log", "w")
    p = subprocess.Popen([kiln, "serve", "--port", "0", "--port-file", port_file, *extra], stderr=log)
    deadline = time.time() + 120
    while not os.path.exists(port_file):
        if p.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"kiln serve {name} did not start: {open(f'{work}/{name}.log').read()[-500:]}")
        time.sleep(0.05)
    return p, f"http://127.0.0.1:{int(open(port_file).read())}"


def stop_server(p):
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def http(url, path, body=None, raw=None, timeout=120):
    """(status, parsed JSON or text) of GET (body None) or POST url+path."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Checks:
    """A check script's results and the servers it starts. `with Checks(work) as check:` empties
    WORK, runs the body (`check(ok, what)` records a result); at its end, or at an exception
    (recorded as a failed check: the ones before it are still reported), the servers are stopped,
    every result is printed with the count, and the script exits 1 if any failed."""

    def __init__(self, work):
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        self.work, self.results, self.servers = work, [], []

    def __call__(self, ok, what):
        self.results.append((bool(ok), what))

    def all_ok(self):
        return all(ok for ok, _ in self.results)

    def server(self, kiln, name, extra=()):
        """start_server, stopped at the end."""
        p, url = start_server(kiln, self.work, name, extra)
        self.servers.append(p)
        return p, url

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if error is not None:
            self(False, f"stopped early: {kind.__name__}: {error}")
        for p in self.servers:
            stop_server(p)
        for ok, what in self.results:
            print(("ok   " if ok else "FAIL ") + what)
        failed = sum(not ok for ok, _ in self.results)
        print(f"{len(self.results) - failed} passed, {failed} failed")
        sys.exit(1 if failed else 0)
