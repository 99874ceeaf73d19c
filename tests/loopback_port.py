"""free_port(): a TCP port on 127.0.0.1 for a store or server a test starts next.

The kernel's own choice (bind to port 0) comes from ip_local_port_range, the range it also
hands out to every outgoing connect(); under `ctest -j` another test's connection can take
that port before the store binds it (EADDRINUSE at the rendezvous). So the port is drawn at
random from below that range, as kiln::parallel::free_loopback_port does, and checked free."""
import random, socket

LOWEST = 15000  # above the ports services commonly listen on


def ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port():
    high = ephemeral_low() - 1
    if high - LOWEST >= 1000:
        for port in random.sample(range(LOWEST, high + 1), 200):
            if bindable(port):
                return port
    with socket.socket() as s:  # a narrow or exhausted range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
