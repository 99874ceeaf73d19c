"""Shared by the `kiln serve` checks: start a server on a free loopback port, talk JSON to it."""
import json, os, subprocess, time, urllib.error, urllib.request


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
