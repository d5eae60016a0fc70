"""What signing every record costs (issue 12, item 5): RSA-2048 sign and verify per record, and the
time of one read of a matchmaking board of N records, signed against unsigned, on a swarm of DHTs on
127.0.0.1 (every peer polls its board with such a read). Stores per round are unchanged by signing:
each record is still one store, signed once by the writer's DHT and verified by every replica.

    python benchmarks/signed_records.py [--records 30] [--reads 30] [--peers 4]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from pathlib import Path

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from hivemind_ext.p2p.signing import CachingSignatureValidator, default_signing_key, owner_marker, signed_subkey

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import emit, lower_is_better
from swarm import local_swarm

PEER = "12D3KooWAjvWiHM4xCJJHfShepw9DdnsihV9DbxXmGsgTdnkS5EX"
DECLARATION = {
    "state": "looking",
    "prefix": "run_42_grads",
    "declared_at": 1.7e9,
    "ready_at": 1.7e9,
    "deadline": 1.7e9,
    "bandwidth": None,
    "client_mode": False,
    "auxiliary": False,
    "fingerprint": "ab" * 16,
}


def sign_and_verify(count: int = 300) -> tuple[float, float, int]:
    key = RSAPrivateKey()
    validator = RSASignatureValidator(key)
    subkey = signed_subkey(f"d/{PEER}/{secrets.token_hex(8)}", PEER, owner_marker(key))
    record = DHTRecord(b"k" * 20, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(DECLARATION), 1.7e9)
    started = time.perf_counter()
    for _ in range(count):
        signed = validator.sign_value(record)
    sign = (time.perf_counter() - started) / count
    signed_record = DHTRecord(record.key, record.subkey, signed, record.expiration_time)
    started = time.perf_counter()
    for _ in range(count):
        validator.validate(signed_record)
    verify = (time.perf_counter() - started) / count
    return sign, verify, len(signed) - len(record.value) + len(owner_marker(key))


def board_reads(peers: int, records: int, reads: int) -> tuple[float, float]:
    with local_swarm(peers) as dhts:
        owners = []
        for dht in dhts:
            key = default_signing_key(dht)
            dht.add_validators([CachingSignatureValidator(key)])
            owners.append(owner_marker(key))
        plain, signed = f"bench-{secrets.token_hex(4)}", f"bench-{secrets.token_hex(4)}"
        until = get_dht_time() + 600
        for index in range(records):
            writer = index % peers
            tag = f"d/{PEER}/{index:016x}"
            dhts[writer].store(plain, DECLARATION, until, subkey=tag)
            dhts[writer].store(signed, DECLARATION, until, subkey=signed_subkey(tag, PEER, owners[writer]))
        medians = []
        for key in (plain, signed):
            times = []
            for _ in range(reads):
                started = time.perf_counter()
                found = dhts[-1].get(key, latest=True)
                times.append(time.perf_counter() - started)
                assert found is not None and len(found.value) == records, "not every record is visible"
            medians.append(statistics.median(times))
        return medians[0], medians[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=30)
    parser.add_argument("--reads", type=int, default=30)
    parser.add_argument("--peers", type=int, default=4)
    args = parser.parse_args()
    sign, verify, extra = sign_and_verify()
    print(f"RSA-2048 per record: sign {sign * 1e3:.2f} ms, verify {verify * 1e3:.3f} ms, +{extra} bytes")
    unsigned, signed = board_reads(args.peers, args.records, args.reads)
    print(
        f"one read of a board of {args.records} records ({args.peers} DHTs): signed {signed * 1e3:.1f} ms, "
        f"unsigned {unsigned * 1e3:.1f} ms, ratio {signed / unsigned:.2f}"
    )
    # hivemind's matchmaking stores the same declarations unsigned: its figure is the unsigned read
    board = f"read a board of {args.records} records, {args.peers} DHTs (hivemind: unsigned records)"
    emit(
        "signed_records",
        [
            lower_is_better("RSA-2048 sign one record", "ms", round(sign * 1e3, 3), None),
            lower_is_better("RSA-2048 verify one record", "ms", round(verify * 1e3, 3), None),
            lower_is_better(board, "ms", round(signed * 1e3, 2), round(unsigned * 1e3, 2)),
        ],
    )


if __name__ == "__main__":
    main()
