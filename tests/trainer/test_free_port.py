"""free_port picks MASTER_PORTs outside the kernel's ephemeral range, so outgoing connections cannot take them."""
import socket

from gspo_ray.trainer.parallel import free_port


def test_ports_sit_below_the_ephemeral_range_are_bindable_and_honour_exclude():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    taken: set[int] = set()
    for _ in range(20):
        port = free_port(exclude=taken)
        assert port not in taken
        assert 20000 <= port < low, (port, low)
        taken.add(port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # free, so a store could listen on it
        s.bind(("0.0.0.0", next(iter(taken))))
