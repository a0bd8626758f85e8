"""Locked instructions per request, from two callgrind profiles made with
`--dump-instr=yes` (N1 and N2 requests): the executions of the binary's instructions
with a `lock` prefix or an `xchg` with memory (atomic read-modify-writes), the
difference over N2 - N1. An atomic update to a cache line another core wrote last
must fetch the line first, which instruction counts do not show (docs/performance.md,
"A ninth sitting"). Prints the total and the functions with the most.

    python3 scripts/lib/locked_per_request.py BINARY PROFILE_N1 PROFILE_N2 REQUESTS [TOP]
"""
import collections
import re
import subprocess
import sys


def locked_addresses(binary):
    """Addresses of the binary's atomic instructions (`lock`-prefixed, or `xchg`
    with a memory operand: always locked)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", binary],
                         capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        m = re.match(r"\s+([0-9a-f]+):\s+(lock |xchg\s+\S*\(.*)", line)
        if m:
            found.add(int(m.group(1), 16))
    return found


def self_costs(path, object_part):
    """Instructions executed per address (self cost, calls excluded) of the objects
    whose path contains `object_part`, and the function of each address."""
    names, cost, function = {}, collections.Counter(), {}
    ob = fn = None
    last, in_call = 0, False

    def named(kind, text):
        m = re.match(r"\((\d+)\)(?: (.*))?", text)
        if not m:
            return text
        if m.group(2):
            names[(kind, m.group(1))] = m.group(2)
        return names.get((kind, m.group(1)), text)

    for line in open(path, errors="replace"):
        line = line.rstrip("\n")
        if not line:
            continue
        if line.startswith("ob="):
            ob = named("ob", line[3:])
        elif line.startswith("fn="):
            fn = named("fn", line[3:])
        elif line.startswith("cob="):
            named("ob", line[4:])
        elif line.startswith("cfn="):
            named("fn", line[4:])
        elif line.startswith("calls="):
            in_call = True
        elif line[0] in "0123456789+-*":
            parts = line.split()
            a = parts[0]
            if a.startswith("0x"):
                address = int(a, 16)
            elif a[0] in "+-":
                step = int(a[1:], 16) if a[1:].startswith("0x") else int(a[1:])
                address = last + step if a[0] == "+" else last - step
            elif a == "*":
                address = last
            else:
                address = int(a)
            last = address
            if in_call:
                in_call = False
                continue
            if len(parts) >= 3 and ob and object_part in ob:
                cost[address] += int(parts[2])
                function[address] = fn
    return cost, function


def main():
    binary, a, b, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    top = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    locked = locked_addresses(binary)
    part = binary.rsplit("/", 1)[-1]
    ca, _ = self_costs(a, part)
    cb, fb = self_costs(b, part)
    per_function = collections.Counter()
    for address in locked & set(cb):
        per_function[fb[address]] += (cb[address] - ca.get(address, 0)) / n
    total = sum(per_function.values())
    print(f"{'':>16}{total:>9.1f} locked instructions per request (in {part} itself)")
    for name, count in per_function.most_common(top):
        if count >= 0.5:
            print(f"{count:>12.1f}  {name[:140]}")


if __name__ == "__main__":
    main()
