"""scale.py's progress-record case (issue 14 item 3): what reading the swarm's progress records costs a
peer as the swarm grows, N = 8, 16, 32, 64.

Every trainer publishes one signed record under the run's progress key and reads all of them every
refresh period (0.5-10 s, shorter near an epoch's end). Here N simulated writers' records live in a
real DHT: a few DHT processes (hivemind's, with libp2p daemons) sign and store them, each record
signed with its writer's own RSA key (:class:`MultiKeySigner`, a stand-in for N trackers, which would
need N DHT processes), and a real :class:`~hivemind_ext.optim.progress.ProgressTracker` on another
DHT reads them with ``fetch_now()`` (the DHT read, the signature checks of its node, parsing and the
progress rules). Per N: the median seconds of one read, the CPU seconds it took in the trainer's
process (parsing, the progress rules, the RPC to its DHT process), and the bytes of the records.
"""

from __future__ import annotations

import statistics
import time

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from hivemind_ext.optim.progress import LocalTrainingProgress, ProgressTracker, progress_value

BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


class MultiKeySigner(RecordValidatorBase):
    """Signs a record under an ``[owner:<key>]`` subkey with that key, for any of ``keys``: one DHT
    process then writes the records of many simulated peers, each validly signed by its own key.
    Validation is hivemind's (the signature must match the key in the subkey)."""

    def __init__(self, keys: list[RSAPrivateKey]) -> None:
        self.signers = [RSASignatureValidator(key) for key in keys]

    def sign_value(self, record: DHTRecord) -> bytes:
        for signer in self.signers:
            if signer.local_public_key in record.subkey:
                return signer.sign_value(record)
        return record.value

    def validate(self, record: DHTRecord) -> bool:
        return self.signers[0].validate(record) if self.signers else True

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.signers[0].strip_value(record) if self.signers else record.value

    @property
    def priority(self) -> int:
        return 10  # RSASignatureValidator's: before validators that deserialize the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def fake_peer_id(index: int) -> str:
    """A base58 string that parses as a peer id (records are parsed strictly)."""
    digits, value = [], index + 10**12
    while value:
        value, rest = divmod(value, 58)
        digits.append(BASE58[rest])
    return "12D3KooW" + "".join(digits).rjust(44, "1")


def measure_progress_reads(counts: tuple[int, ...] = (8, 16, 32, 64), writers: int = 3, reads: int = 15) -> list[dict]:
    """Per swarm size: ``{"peers", "read_s", "cpu_s", "bytes"}`` (medians over ``reads`` reads)."""
    keys = [RSAPrivateKey() for _ in range(max(counts))]
    bootstrap = hivemind.DHT(start=True)
    initial = [str(a) for a in bootstrap.get_visible_maddrs()]
    shares = [keys[w::writers] for w in range(writers)]
    nodes = [hivemind.DHT(initial_peers=initial, start=True, record_validators=[MultiKeySigner(s)]) for s in shares]
    reader = hivemind.DHT(initial_peers=initial, start=True)
    rows = []
    try:
        for count in counts:
            prefix = f"progress_cost_{count}"
            tracker = ProgressTracker(reader, prefix, target_batch_size=10**9, start=False)
            try:
                key = tracker.training_progress_key
                now = get_dht_time()
                for index in range(count):
                    signer = RSASignatureValidator(keys[index])
                    record = LocalTrainingProgress(fake_peer_id(index), 0, 10, 1.0, now, False)
                    node = nodes[index % writers]
                    ok = node.store(key, progress_value(record), now + 600, subkey=signer.local_public_key)
                    if not ok:
                        raise RuntimeError(f"the DHT refused simulated record {index}")
                seconds, cpu = [], []
                for _ in range(reads):
                    started, started_cpu = time.perf_counter(), time.process_time()
                    progress = tracker.fetch_now(timeout=30)
                    seconds.append(time.perf_counter() - started)
                    cpu.append(time.process_time() - started_cpu)
                if progress.num_peers != count + 1:
                    raise RuntimeError(f"the tracker saw {progress.num_peers} peers, expected {count + 1}")
                found = reader.get(key, latest=True)
                entries = [(sub, item.value, item.expiration_time) for sub, item in found.value.items()]
                size = sum(len(sub) + len(MSGPackSerializer.dumps(value)) for sub, value, _ in entries)
                rows.append(
                    dict(peers=count, read_s=statistics.median(seconds), cpu_s=statistics.median(cpu), bytes=size)
                )
                print(
                    f"progress records, {count} peers: read {rows[-1]['read_s'] * 1e3:.1f} ms (median of {reads}), "
                    f"{rows[-1]['cpu_s'] * 1e3:.2f} ms CPU in the reader's process, {size / 1e3:.1f} kB",
                    flush=True,
                )
            finally:
                tracker.shutdown()
    finally:
        for dht in (reader, *nodes, bootstrap):
            dht.shutdown()
    return rows
