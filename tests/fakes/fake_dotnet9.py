#!/usr/bin/env python3
"""A stand-in for a .NET 9 runtime that sends wait-handle events.

No .NET 9 runtime can be installed on the test machines (the registries
carry .NET 8 and .NET Core 3.1 only), so this process plays the part of
one, at the level clrbpf sees a runtime:

- its mappings name a .NET 9 shared framework
  (`.../Microsoft.NETCore.App/9.0.0/libcoreclr.so`, and
  `System.Private.CoreLib.dll`, which says the runtime has started);
- it serves the diagnostic IPC protocol on the socket CoreCLR creates
  (`/tmp/dotnet-diagnostic-PID-STARTTICKS-socket`): ProcessInfo2 (product
  version 9.0.0), EnablePerfMap (writes `/tmp/perf-PID.map` naming the
  methods of the scenario's stacks, at addresses in an executable
  anonymous mapping, as JIT code lives), DisablePerfMap, CollectTracing2
  and StopTracing; anything else gets the runtime's "unknown command";
- a session whose `Microsoft-Windows-DotNETRuntime` provider asks for the
  WaitHandle keyword (0x40000000000) at level Verbose gets the scenario's
  WaitHandleWaitStart (301) / WaitHandleWaitStop (302) events as a
  NetTrace V4 stream, with the runtime's metadata records, stack blocks
  and compressed event headers, timestamps in CLOCK_MONOTONIC ns (the
  runtime's tick clock on Linux). Other sessions get an empty stream.
  A session ends on StopTracing with the end-of-stream tag, or, with
  `"end": "cut"`, the stream is cut inside an event block that holds the
  Stops of the waits still open, and the connection closed.

A scenario may list ContentionStop (91, version 1) events instead,
`{"kind": "contention_stop", "duration_ns": N}`: they go to any session
that asks for the Contention keyword (0x4000) at level Informational,
DurationNs as given (a hostile runtime's 2^63, issue 33), and
GCAllocationTick (10, version 4) events, `{"kind": "allocation",
"amount": N, "object_size": N, "type": "Evil.Blob"}`: they go to any
session that asks for the GC keyword (0x1) at level Verbose,
AllocationAmount64 as given (a hostile runtime's u64::MAX). Exceptions, `{"kind": "exception", "type": "Evil.A", "message": "..."}`,
are ExceptionThrown (80, version 1) events: they go to any session that
asks for the Exception keyword (0x8000) at level Error. A session
gets the scenario's events of the kinds it asks for.

A scenario's `"counters": {"exception-count": 1.8446744073709552e19}`
answers every session that asks for the `System.Runtime` provider
(`EventCounterIntervalSec=N`) with one EventCounters event per counter
every N seconds until it stops, each an incrementing counter whose
Increment is the value given (a hostile runtime's u64::MAX). The
EventCounters metadata is self-describing, as the runtime's: a `Payload`
object with the fields of `IncrementingCounterPayload`.

An event's `at_abs_ns`, where given, is its timestamp (CLOCK_MONOTONIC
ns, masked to 64 bits: 0 is a wait that began before the machine booted);
`at_ns` then only orders it in the stream.

The scenario (argv[1], JSON) lists the events:
  {"end": "stop" | "cut",
   "events": [{"tid": 11, "at_ns": 1000000, "kind": "start",
               "source": 0 | 1, "stack": ["leaf method", "caller", ...]},
              {"tid": 11, "at_ns": 121000000, "kind": "stop",
               "stack": [...]}]}
Method names are written as the runtime writes them in perf maps
("void [System.Private.CoreLib] System.Threading.WaitHandle::WaitOne()[Optimized]").
`at_ns` counts from the moment the session starts.

It prints PID and READY like the C# workloads, `SESSION keywords=0x...
level=N peer=PID` for every session (PID: the client's), `WAITS_SENT
peer=PID` once a session's events are written, then `SENT kinds=K,...
peer=PID` with the kinds of those events. It lives argv[2] seconds,
keeps its files in the directory argv[3] and removes its socket and files
when it ends (a test that kills it removes the socket).
"""

import ctypes
import datetime
import json
import mmap
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time

from wire import utf16z, varuint

RUNTIME_PROVIDER = "Microsoft-Windows-DotNETRuntime"
WAIT_HANDLE_KEYWORD = 0x40000000000
CONTENTION_KEYWORD = 0x4000
GC_KEYWORD = 0x1
EXCEPTION_KEYWORD = 0x8000
COUNTERS_PROVIDER = "System.Runtime"
LEVEL_ERROR = 2
LEVEL_INFO = 4
LEVEL_VERBOSE = 5
IPC_MAGIC = b"DOTNET_IPC_V1\0"
UNKNOWN_COMMAND = 0x80131385
METHOD_SIZE = 0x200

# NetTrace framing (the runtime's FastSerialization tags).
TAG_NULL_REFERENCE = 1
TAG_BEGIN_PRIVATE_OBJECT = 5
TAG_END_OBJECT = 6

# Type codes of self-describing metadata (TypeCode).
TYPE_OBJECT = 1
TYPE_SINGLE = 13
TYPE_DOUBLE = 14
TYPE_STRING = 18
# The fields of the runtime's IncrementingCounterPayload, in its order.
INCREMENTING_COUNTER_FIELDS = (
    ("Name", TYPE_STRING),
    ("DisplayName", TYPE_STRING),
    ("DisplayRateTimeScale", TYPE_STRING),
    ("Increment", TYPE_DOUBLE),
    ("IntervalSec", TYPE_SINGLE),
    ("Series", TYPE_STRING),
    ("CounterType", TYPE_STRING),
    ("Metadata", TYPE_STRING),
    ("DisplayUnits", TYPE_STRING),
)
MASK64 = 0xFFFF_FFFF_FFFF_FFFF
# The thread the runtime's counter timer writes from.
COUNTER_THREAD = 99




class Stream:
    """A NetTrace stream being sent: tracks the absolute offset, which the
    padding of block objects depends on."""

    def __init__(self, conn):
        self.conn = conn
        self.offset = 0

    def send(self, data):
        self.conn.sendall(data)
        self.offset += len(data)

    def head(self, sync_qpc):
        out = bytearray(b"Nettrace")
        sig = b"!FastSerialization.1"
        out += struct.pack("<i", len(sig)) + sig
        out += bytes([TAG_BEGIN_PRIVATE_OBJECT, TAG_BEGIN_PRIVATE_OBJECT, TAG_NULL_REFERENCE])
        out += struct.pack("<iii", 4, 4, 5) + b"Trace" + bytes([TAG_END_OBJECT])
        now = datetime.datetime.now(datetime.timezone.utc)
        out += struct.pack(
            "<8H",
            now.year,
            now.month,
            now.isoweekday() % 7,
            now.day,
            now.hour,
            now.minute,
            now.second,
            now.microsecond // 1000,
        )
        # QPC ticks are CLOCK_MONOTONIC ns on Linux: frequency 1e9.
        out += struct.pack("<qqIIII", sync_qpc, 1_000_000_000, 8, os.getpid(), os.cpu_count() or 1, 1000)
        out += bytes([TAG_END_OBJECT])
        self.send(bytes(out))

    def block(self, type_name, body, cut_at=None):
        """A block object; with `cut_at`, only its first bytes."""
        out = bytearray([TAG_BEGIN_PRIVATE_OBJECT, TAG_BEGIN_PRIVATE_OBJECT, TAG_NULL_REFERENCE])
        name = type_name.encode()
        out += struct.pack("<iii", 2, 2, len(name)) + name + bytes([TAG_END_OBJECT])
        out += struct.pack("<i", len(body))
        out += bytes((4 - ((self.offset + len(out)) & 3)) & 3)
        out += body + bytes([TAG_END_OBJECT])
        self.send(bytes(out if cut_at is None else out[:cut_at]))

    def end(self):
        self.send(bytes([TAG_NULL_REFERENCE]))


class BlobBlock:
    """An EventBlock or MetadataBlock body with header compression."""

    FIELDS = ("metadata_id", "sequence", "capture_thread_id", "processor", "thread_id", "stack_id", "timestamp")

    def __init__(self):
        self.body = bytearray(struct.pack("<HHqq", 20, 1, 0, 0x7FFF_FFFF_FFFF_FFFF))
        self.previous = dict.fromkeys(self.FIELDS, 0)
        self.previous_size = 0

    def blob(self, payload, **spec):
        p = self.previous
        s = dict(p, **spec) if spec else dict.fromkeys(self.FIELDS, 0)
        flags, fields = 0, bytearray()
        if s["metadata_id"] != p["metadata_id"]:
            flags |= 0x01
            fields += varuint(s["metadata_id"])
        expected = (p["sequence"] + 1) & 0xFFFFFFFF if s["metadata_id"] != 0 else p["sequence"]
        if (
            s["sequence"] != expected
            or s["capture_thread_id"] != p["capture_thread_id"]
            or s["processor"] != p["processor"]
        ):
            flags |= 0x02
            fields += varuint((s["sequence"] - expected) & 0xFFFFFFFF)
            fields += varuint(s["capture_thread_id"])
            fields += varuint(s["processor"])
        if s["thread_id"] != p["thread_id"]:
            flags |= 0x04
            fields += varuint(s["thread_id"])
        if s["stack_id"] != p["stack_id"]:
            flags |= 0x08
            fields += varuint(s["stack_id"])
        fields += varuint((s["timestamp"] - p["timestamp"]) & 0xFFFF_FFFF_FFFF_FFFF)
        if len(payload) != self.previous_size:
            flags |= 0x80
            fields += varuint(len(payload))
        self.body += bytes([flags]) + fields + payload
        self.previous = s
        self.previous_size = len(payload)


METADATA = (
    (1, 301, "WaitHandleWaitStart", WAIT_HANDLE_KEYWORD, 0, LEVEL_VERBOSE),
    (2, 302, "WaitHandleWaitStop", WAIT_HANDLE_KEYWORD, 0, LEVEL_VERBOSE),
    # ContentionStop_V1: its payload carries DurationNs.
    (3, 91, "ContentionStop", CONTENTION_KEYWORD, 1, LEVEL_INFO),
    # GCAllocationTick_V4: AllocationAmount64 and ObjectSize.
    (4, 10, "GCAllocationTick", GC_KEYWORD, 4, LEVEL_VERBOSE),
    # ExceptionThrown_V1: type, message, EIP, HRESULT, flags.
    (5, 80, "ExceptionThrown", EXCEPTION_KEYWORD, 1, LEVEL_ERROR),
)
COUNTERS_METADATA_ID = 6
# The metadata id of each scenario event kind.
KIND_METADATA = {"start": 1, "stop": 2, "contention_stop": 3, "allocation": 4, "exception": 5}
# The keyword and least level a session asks for to get each kind.
KIND_ENABLED_BY = {
    "start": (WAIT_HANDLE_KEYWORD, LEVEL_VERBOSE),
    "stop": (WAIT_HANDLE_KEYWORD, LEVEL_VERBOSE),
    "contention_stop": (CONTENTION_KEYWORD, LEVEL_INFO),
    "allocation": (GC_KEYWORD, LEVEL_VERBOSE),
    "exception": (EXCEPTION_KEYWORD, LEVEL_ERROR),
}


def metadata_block():
    block = BlobBlock()
    for metadata_id, event_id, name, keywords, version, level in METADATA:
        payload = struct.pack("<I", metadata_id) + utf16z(RUNTIME_PROVIDER)
        # The runtime sends its own events' metadata without field
        # descriptions: keywords, version, level, no fields.
        payload += struct.pack("<I", event_id) + utf16z(name)
        payload += struct.pack("<QIII", keywords, version, level, 0)
        block.blob(payload)
    # EventCounters describes its payload: one `Payload` object.
    payload = struct.pack("<I", COUNTERS_METADATA_ID) + utf16z(COUNTERS_PROVIDER)
    payload += struct.pack("<I", 0) + utf16z("EventCounters")
    payload += struct.pack("<QIII", 0, 0, 0, 1)
    payload += struct.pack("<II", TYPE_OBJECT, len(INCREMENTING_COUNTER_FIELDS))
    for name, type_code in INCREMENTING_COUNTER_FIELDS:
        payload += struct.pack("<I", type_code) + utf16z(name)
    payload += utf16z("Payload")
    block.blob(payload)
    return bytes(block.body)


def counter_payload(name, increment, interval_sec):
    """An IncrementingCounterPayload: `increment` over `interval_sec`."""
    out = utf16z(name) + utf16z(name) + utf16z("00:00:01")
    out += struct.pack("<df", float(increment), float(interval_sec))
    out += utf16z(f"Interval={int(interval_sec * 1000)}") + utf16z("Sum") + utf16z("") + utf16z("")
    return out


class Runtime:
    def __init__(self, scenario, code_base):
        self.scenario = scenario
        names = []
        for event in scenario["events"]:
            for name in event.get("stack", []):
                if name not in names:
                    names.append(name)
        self.methods = {name: code_base + i * METHOD_SIZE for i, name in enumerate(names)}
        self.stops = {}
        self.lock = threading.Lock()
        self.next_session = 0x5E55_1000

    def return_address(self, name):
        return self.methods[name] + 0x40

    def write_perf_map(self):
        path = f"/tmp/perf-{os.getpid()}.map"
        with open(path + ".tmp", "w") as f:
            for name, start in self.methods.items():
                f.write(f"{start:x} {METHOD_SIZE:x} {name}\n")
        os.rename(path + ".tmp", path)

    def serve(self, listener):
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn):
        try:
            header = recv_exactly(conn, 20)
            if header[:14] != IPC_MAGIC:
                return
            size, command_set, command_id = struct.unpack_from("<HBB", header, 14)
            payload = recv_exactly(conn, size - 20)
            command = (command_set, command_id)
            if command == (0x04, 0x04):
                reply(conn, self.process_info())
            elif command == (0x04, 0x05):
                self.write_perf_map()
                reply(conn, struct.pack("<I", 0))
            elif command == (0x04, 0x06):
                reply(conn, struct.pack("<I", 0))
            elif command == (0x02, 0x03):
                self.session(conn, payload)
            elif command == (0x02, 0x01):
                (session_id,) = struct.unpack_from("<Q", payload)
                with self.lock:
                    stop = self.stops.get(session_id)
                if stop is not None:
                    stop.set()
                reply(conn, struct.pack("<Q", session_id))
            else:
                reply(conn, struct.pack("<I", UNKNOWN_COMMAND), ok=False)
        except (OSError, ValueError, struct.error):
            pass
        finally:
            conn.close()

    def process_info(self):
        out = struct.pack("<Q", os.getpid()) + os.urandom(16)
        for text in (" ".join(sys.argv), "Linux", "x64", "Waits", "9.0.0+fake-stand-in"):
            units = text.encode("utf-16-le") + b"\0\0"
            out += struct.pack("<I", len(units) // 2) + units
        return out

    def session(self, conn, payload):
        keywords, level, counters_interval = 0, 0, None
        _buffer_mb, _format, _rundown, count = struct.unpack_from("<IIBI", payload)
        at = 13
        for _ in range(count):
            provider_keywords, provider_level = struct.unpack_from("<QI", payload, at)
            at += 12
            name, at = read_string(payload, at)
            _filter, at = read_string(payload, at)
            if name == RUNTIME_PROVIDER:
                keywords, level = provider_keywords, provider_level
            elif name == COUNTERS_PROVIDER and _filter.startswith("EventCounterIntervalSec="):
                counters_interval = max(1, int(_filter.split("=", 1)[1]))
        with self.lock:
            session_id = self.next_session
            self.next_session += 1
            stop = self.stops.setdefault(session_id, threading.Event())
        # Every session that asks gets the events of the kinds it asks
        # for, as every session of a runtime gets the events of its time
        # (other profilers on the host may open sessions too).
        events = [
            e
            for e in self.scenario["events"]
            if keywords & KIND_ENABLED_BY[e["kind"]][0] and level >= KIND_ENABLED_BY[e["kind"]][1]
        ]
        wants_waits = bool(events)
        counters = self.scenario.get("counters", {}) if counters_interval else {}
        peer, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        print(f"SESSION keywords={keywords:#x} level={level} peer={peer}", flush=True)
        reply(conn, struct.pack("<Q", session_id))
        stream = Stream(conn)
        base = time.monotonic_ns()
        stream.head(base)
        # Stack ids and sequence numbers are the session's own.
        state = {"next_stack_id": 1, "sequences": {}}
        if wants_waits or counters:
            stream.block("MetadataBlock", metadata_block())
        if wants_waits:
            # As a runtime, after the session is set up: the first waits
            # come a moment later.
            time.sleep(0.2)
            self.send_waits(stream, base + 200_000_000, state, events)
            kinds = ",".join(sorted({e["kind"] for e in events}))
            print(f"WAITS_SENT peer={peer}", flush=True)
            print(f"SENT kinds={kinds} peer={peer}", flush=True)
            if self.scenario.get("end") == "cut":
                self.cut(stream, base + 200_000_000, state)
                conn.shutdown(socket.SHUT_RDWR)
                return
        # The counter timer fires one interval after the session began,
        # then every interval, until the session stops.
        while not stop.wait(counters_interval or None):
            self.send_counters(stream, state, counters, counters_interval)
        stream.end()

    def send_counters(self, stream, state, counters, interval_sec):
        block = BlobBlock()
        sequences = state["sequences"]
        for name, value in counters.items():
            sequences[COUNTER_THREAD] = sequences.get(COUNTER_THREAD, 0) + 1
            block.blob(
                counter_payload(name, value, interval_sec),
                metadata_id=COUNTERS_METADATA_ID,
                sequence=sequences[COUNTER_THREAD],
                capture_thread_id=COUNTER_THREAD,
                processor=0,
                thread_id=COUNTER_THREAD,
                stack_id=0,
                timestamp=time.monotonic_ns(),
            )
        stream.block("StackBlock", struct.pack("<II", state["next_stack_id"], 0))
        stream.block("EventBlock", bytes(block.body))

    def stack_ids(self, events, state):
        """Stack ids of the events' stacks (0: none), numbered on from the
        last block's as the runtime does, and their StackBlock."""
        first = state["next_stack_id"]
        stacks, ids = [], []
        for event in events:
            ips = [self.return_address(name) for name in event.get("stack", [])]
            if not ips:
                ids.append(0)
                continue
            stacks.append(ips)
            ids.append(first + len(stacks) - 1)
        state["next_stack_id"] += len(stacks)
        body = struct.pack("<II", first, len(stacks))
        for ips in stacks:
            body += struct.pack("<I", 8 * len(ips)) + struct.pack(f"<{len(ips)}Q", *ips)
        return ids, body

    def event_block(self, events, base, state):
        ids, stack_body = self.stack_ids(events, state)
        sequences = state["sequences"]
        block = BlobBlock()
        for event, stack_id in zip(events, ids):
            tid = event["tid"]
            sequences[tid] = sequences.get(tid, 0) + 1
            metadata_id = KIND_METADATA[event["kind"]]
            if event["kind"] == "start":
                payload = struct.pack("<BQH", event.get("source", 0), 0x7F00_DEAD_0000 + tid, 0)
            elif event["kind"] == "contention_stop":
                # Flags, ClrInstanceID, DurationNs: whatever the scenario
                # says (a hostile one says 2^63).
                payload = struct.pack("<BHd", 0, 0, float(event["duration_ns"]))
            elif event["kind"] == "allocation":
                # AllocationAmount (the wide one truncated), AllocationKind
                # (SOH), ClrInstanceID, AllocationAmount64, TypeID,
                # TypeName, HeapIndex, Address, ObjectSize.
                amount = event["amount"]
                payload = struct.pack("<IIHQQ", amount & 0xFFFFFFFF, 0, 0, amount, 0x7F00_7E00_0000)
                payload += utf16z(event.get("type", "Evil.Blob"))
                payload += struct.pack("<IQQ", 0, 0x7F00_BEEF_0000, event["object_size"])
            elif event["kind"] == "exception":
                # ExceptionType, ExceptionMessage, ExceptionEIP,
                # ExceptionHRESULT, ExceptionFlags, ClrInstanceID.
                payload = utf16z(event.get("type", "Evil.Exception"))
                payload += utf16z(event.get("message", ""))
                eip = self.return_address(event["stack"][0]) if event.get("stack") else 0
                payload += struct.pack("<QIHH", eip, 0x80131500, 0, 0)
            else:
                payload = struct.pack("<H", 0)
            block.blob(
                payload,
                metadata_id=metadata_id,
                sequence=sequences[tid],
                capture_thread_id=tid,
                processor=0,
                thread_id=tid,
                stack_id=stack_id,
                timestamp=event.get("at_abs_ns", base + event["at_ns"]) & MASK64,
            )
        return stack_body, bytes(block.body)

    def send_waits(self, stream, base, state, events):
        events = sorted(events, key=lambda e: e["at_ns"])
        # Several blocks, as a runtime flushes its buffers: a wait may
        # start in one and end in the next.
        for chunk in (events[i : i + 3] for i in range(0, len(events), 3)):
            # As a runtime, a block leaves once its events have happened:
            # clrbpf takes no event as later than its arrival. Only an
            # attacker's own `at_abs_ns` stamps may lie in the future.
            due = max((base + e["at_ns"] for e in chunk if "at_abs_ns" not in e), default=0)
            time.sleep(max(0, due - time.monotonic_ns()) / 1e9)
            stack_body, event_body = self.event_block(chunk, base, state)
            stream.block("StackBlock", stack_body)
            stream.block("EventBlock", event_body)

    def cut(self, stream, base, state):
        """An event block holding the Stops of the waits still open, cut
        halfway: those Stops never arrive."""
        open_waits = {}
        for event in sorted(self.scenario["events"], key=lambda e: e["at_ns"]):
            if event["kind"] == "start":
                open_waits[event["tid"]] = event
            else:
                open_waits.pop(event["tid"], None)
        last = max(e["at_ns"] for e in self.scenario["events"])
        stops = [{"tid": tid, "at_ns": last + 1_000_000, "kind": "stop"} for tid in open_waits]
        _, event_body = self.event_block(stops or [{"tid": 1, "at_ns": last, "kind": "stop"}], base, state)
        stream.block("EventBlock", event_body, cut_at=len(event_body) // 2)


def recv_exactly(conn, n):
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ValueError("connection closed")
        data += chunk
    return bytes(data)


def read_string(payload, at):
    (count,) = struct.unpack_from("<I", payload, at)
    at += 4
    text = payload[at : at + 2 * count].decode("utf-16-le").rstrip("\0")
    return text, at + 2 * count


def reply(conn, payload, ok=True):
    header = IPC_MAGIC + struct.pack("<HBBH", 20 + len(payload), 0xFF, 0x00 if ok else 0xFF, 0)
    conn.sendall(header + payload)


def main():
    with open(sys.argv[1]) as f:
        scenario = json.load(f)
    seconds = float(sys.argv[2])
    workdir = tempfile.mkdtemp(prefix="fake-dotnet9-", dir=sys.argv[3])
    framework = os.path.join(workdir, "shared", "Microsoft.NETCore.App", "9.0.0")
    os.makedirs(framework)
    mappings = []
    for name in ("libcoreclr.so", "System.Private.CoreLib.dll"):
        lib = os.path.join(framework, name)
        with open(lib, "wb") as f:
            f.write(b"\0" * 4096)
        fd = os.open(lib, os.O_RDONLY)
        mappings.append(mmap.mmap(fd, 4096, prot=mmap.PROT_READ | mmap.PROT_EXEC))
        os.close(fd)
    # The "JIT code heap": anonymous executable memory the perf map's
    # methods lie in.
    code = mmap.mmap(
        -1,
        1 << 20,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC,
    )
    code_base = ctypes.addressof(ctypes.c_char.from_buffer(code))
    runtime = Runtime(scenario, code_base)
    stat = open("/proc/self/stat").read()
    start_ticks = stat.rsplit(")", 1)[1].split()[19]
    path = f"/tmp/dotnet-diagnostic-{os.getpid()}-{start_ticks}-socket"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(8)
    threading.Thread(target=runtime.serve, args=(listener,), daemon=True).start()
    print(f"PID {os.getpid()}", flush=True)
    print("READY", flush=True)
    try:
        time.sleep(seconds)
    finally:
        os.unlink(path)
        for stale in (f"/tmp/perf-{os.getpid()}.map",):
            if os.path.exists(stale):
                os.unlink(stale)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
