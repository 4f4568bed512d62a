"""A KV events publisher that follows vLLM's, for proxy/tests/kv_events.rs.

The event structs and the sockets are vLLM's (vllm/distributed/kv_events.py, vllm-project/vllm
at 0181ea3, and v0.23 for the positional form): msgspec structs encoded by
msgspec.msgpack.Encoder, published as [topic, seq (8 bytes, big-endian, from 0), payload] on a
PUB socket, with an in-memory buffer served on a ROUTER socket: a request
[identity, b"", start_seq] is answered with [identity, b"", seq, payload] for every buffered
batch from start_seq on, then [identity, b"", -1 (8 bytes, signed), b""].

Two encodings, chosen per batch: "map" (vLLM main: tagged structs encoded as maps) and "array"
(vLLM up to v0.23: array_like structs, an event ["BlockStored", ...], the batch [ts, events,
rank]).

Driven by JSON lines on stdin, each answered with "ok" on stdout once done:
  {"op": "stored", "hashes": [...], "parent": h | null, "tokens": [...], "block_size": 16,
   "medium": "GPU", "lora_name": null, "extra_keys": null}
  {"op": "removed", "hashes": [...], "medium": "GPU"}
  {"op": "cleared"}
  {"op": "encoding", "value": "map" | "array"}
  {"op": "hold"}     the next batch is buffered for replay but not published (a lost message)
  {"op": "forget"}   the next batch is neither published nor buffered (lost for good)
  {"op": "garbage"}  a batch whose payload is not msgpack, with the next seq
  {"op": "raw", "frames": ["hex", ...]}  one multipart message as given
  {"op": "huge", "bytes": n}  one message whose payload is n bytes
  {"op": "replay_lie", "seq": n}  replays from now on number their batches n, n + 1, ...
  {"op": "rewind"}   the next batch is numbered 0 again (a publisher restarted behind a forwarder)
  {"op": "replays"}  answered "ok <replay requests served so far>"
Prints "ready <pub port> <replay port>" first.
"""

import json
import sys
import time

import msgspec
import zmq


# vLLM main: tagged structs as maps.
class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


# vLLM up to v0.23: array_like structs.
class ArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


def main():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(100_000)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    encoder = msgspec.msgpack.Encoder()
    buffer = []
    seq = 0
    encoding = "map"
    mode = None
    lie = None
    replays = 0
    print(f"ready {pub_port} {replay_port}", flush=True)

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)

    def publish(payload):
        nonlocal seq, mode
        s = seq
        seq += 1
        if mode != "forget":
            buffer.append((s, payload))
        if mode is None:
            pub.send_multipart((b"", s.to_bytes(8, "big"), payload))
        mode = None

    def event(cmd):
        op = cmd["op"]
        as_map = encoding == "map"
        if op == "stored":
            fields = dict(
                block_hashes=cmd["hashes"],
                parent_block_hash=cmd.get("parent"),
                token_ids=cmd["tokens"],
                block_size=cmd.get("block_size", 16),
                lora_id=None,
                medium=cmd.get("medium", "GPU"),
            )
            if not as_map:
                return ArrayBlockStored(**fields)
            return BlockStored(
                **fields,
                lora_name=cmd.get("lora_name"),
                extra_keys=cmd.get("extra_keys"),
                kv_cache_spec_kind="full_attention",
            )
        if op == "removed":
            cls = BlockRemoved if as_map else ArrayBlockRemoved
            return cls(block_hashes=cmd["hashes"], medium=cmd.get("medium", "GPU"))
        return AllBlocksCleared() if as_map else ArrayAllBlocksCleared()

    while True:
        for sock, _ in poller.poll():
            if sock is router:
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start = frames
                start = int.from_bytes(start, "big")
                replays += 1
                for i, (s, payload) in enumerate(b for b in buffer if b[0] >= start):
                    if lie is not None:
                        s = lie + i
                    router.send_multipart((client, b"", s.to_bytes(8, "big"), payload))
                router.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))
                continue
            line = sys.stdin.readline()
            if not line:
                return
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "encoding":
                encoding = cmd["value"]
            elif op in ("hold", "forget"):
                mode = op
            elif op == "replay_lie":
                lie = cmd["seq"]
            elif op == "rewind":
                seq = 0
            elif op == "replays":
                print(f"ok {replays}", flush=True)
                continue
            elif op == "garbage":
                publish(b"\xc1 not msgpack")
            elif op == "raw":
                pub.send_multipart([bytes.fromhex(f) for f in cmd["frames"]])
            elif op == "huge":
                pub.send_multipart((b"", seq.to_bytes(8, "big"), b"\x00" * cmd["bytes"]))
            elif op in ("stored", "removed", "cleared"):
                ev = event(cmd)
                cls = EventBatch if encoding == "map" else ArrayEventBatch
                publish(encoder.encode(cls(ts=time.time(), events=[ev], data_parallel_rank=0)))
            print("ok", flush=True)


if __name__ == "__main__":
    main()
