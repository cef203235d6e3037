"""What one remote party's oversized Fleet API calls cost the SuperLink (issue 44, point 3): the
stock `flower-superlink` (2 GiB gRPC messages) beside `florist superlink` with its receive limit.

    python benchmarks/superlink_memory.py [--max-message-mb 20] [--settle 2]

Each attack meets a fresh SuperLink of each kind, started by `LocalFederation` with no SuperNodes:
- `register`: 4 concurrent `RegisterNode` calls with a 64 MiB public key each, insecure SuperLink
  (anyone who reaches its Fleet port may register);
- `push`: 2 concurrent 256 MiB `PushObject` calls signed by an unregistered key, TLS + node auth;
- `register-under`: 16 concurrent `RegisterNode` calls with keys 1 MiB under the limit, insecure:
  what the limit does not bound (each call is within it and read whole); stock Flower keeps the
  keys, florist's SuperLink refuses keys over 512 bytes.
Prints the SuperLink's RSS before, its peak during (VmHWM, reset at the start), its RSS `--settle`
seconds after the last answer (all in MiB), and how the calls were answered.

Then the registration flood (issue 53): `--flood` registrations of distinct 200-byte keys and
1,000 of one key already taken, 8 at a time over one connection, on a fresh insecure SuperLink
of each kind: its RSS before and after, how much its log grew, and how many nodes it holds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "deploy"))
from fleet_flood import MiB, attack, oversized_push, oversized_register, register_all, status_mib

from florist.deploy import federation
from florist.deploy.certs import make_node_key
from florist.deploy.federation import LocalFederation


def attacks(limit_mb: float) -> dict[str, tuple[dict, Callable[[], list]]]:
    """name: (LocalFederation security options, the requests it sends)."""
    under = int((limit_mb - 1) * MiB)
    return {
        "register 4x64 MiB": ({}, lambda: [oversized_register(64 * MiB) for _ in range(4)]),
        "push 2x256 MiB": ({"tls": True, "auth": True}, lambda: [oversized_push(256 * MiB) for _ in range(2)]),
        f"register 16x{under / MiB:.0f} MiB": ({}, lambda: [oversized_register(under) for _ in range(16)]),
    }


def stock() -> mock._patch:
    """`LocalFederation` as before issue 44: Flower's own `flower-superlink`."""
    return mock.patch.object(
        federation, "superlink_command", lambda _limit: [federation.flower_bin("flower-superlink")]
    )


def measure(work: Path, options: dict, requests, limit_mb: float | None, settle: float) -> str:
    """One table row's figures: the attack on a fresh SuperLink (`limit_mb` None: the stock one)."""
    limit = None if limit_mb is None else int(limit_mb * MiB)
    with (
        stock() if limit is None else nullcontext(),
        LocalFederation(work, [], executor="flower", max_message_bytes=limit, **options) as fed,
    ):
        key, _ = make_node_key(work / "stranger", "stranger")
        ca = fed.certs / "ca.crt" if fed.tls else None
        answers, cost = attack(fed.superlink.pid, fed.fleet_address, requests, key, ca, settle=settle)
    codes = ", ".join(f"{n} {code}" for code, n in Counter(a.code for a in answers).items())
    return f"{cost.before:7.0f} {cost.peak:7.0f} {cost.after:7.0f} {cost.growth:7.0f}  {codes}"


def flood(work: Path, count: int, stock_link: bool) -> str:
    """The registration flood's row on a fresh insecure SuperLink (florist's, or the stock one)."""
    import json
    import os

    with stock() if stock_link else nullcontext(), LocalFederation(work, [], executor="flower") as fed:
        key, _ = make_node_key(work / "stranger", "stranger")
        log = fed.logs / "superlink.log"
        before, logged = status_mib(fed.superlink.pid, "VmRSS"), log.stat().st_size
        keys = [os.urandom(200) for _ in range(count)] + [b"taken" * 40] * 1000
        answers = register_all(fed.fleet_address, keys, key)
        after, grown = status_mib(fed.superlink.pid, "VmRSS"), log.stat().st_size - logged
        listed = fed.flwr("supernode", "list", federation.CONNECTION, "--format", "json")
        held = sum(n["status"] != "unregistered" for n in json.loads(listed.stdout)["nodes"])
    codes = ", ".join(f"{n} {code}" for code, n in Counter(answers).items())
    return f"{before:7.0f} {after:7.0f} {grown / 1e6:9.2f} {held:7d}  {codes}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-message-mb", type=float, default=20.0, help="florist's limit (LocalFederation's default)"
    )
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after the attack before the last RSS")
    parser.add_argument("--flood", type=int, default=20_000, help="registrations of the flood (0: none)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="florist-superlink-memory-"))  # each SuperLink's logs stay there
    print(f"{'attack':<22} {'SuperLink':<26} {'before':>7} {'peak':>7} {'after':>7} {'growth':>7}  answers")
    for i, (name, (options, requests)) in enumerate(attacks(args.max_message_mb).items()):
        for kind, limit in (
            ("flower-superlink", None),
            (f"florist, {args.max_message_mb:g} MiB limit", args.max_message_mb),
        ):
            row = measure(work / f"{i}-{limit}", options, requests, limit, args.settle)
            print(f"{name:<22} {kind:<26} {row}", flush=True)
    if args.flood:
        print(f"\n{'flood':<22} {'SuperLink':<26} {'before':>7} {'after':>7} {'log MB':>9} {'nodes':>7}  answers")
        for kind, stock_link in (("flower-superlink", True), ("florist, defaults", False)):
            row = flood(work / f"flood-{kind[:7]}", args.flood, stock_link)
            print(f"{f'register {args.flood}':<22} {kind:<26} {row}", flush=True)


if __name__ == "__main__":
    main()
