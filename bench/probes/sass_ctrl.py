"""Annotate `cuobjdump -sass` output with each instruction's scheduling control bits (Volta and later):
stall cycles, the scoreboard it sets on write (wb) and on read (rb), and the scoreboards it waits for. Usage:

    cuobjdump -sass kernel.cubin > k.sass; python3 bench/probes/sass_ctrl.py k.sass [pattern]

A wait mask naming the scoreboard of loads issued just before is a wait for those loads too: ptxas counts loads
per scoreboard, not per load (docs/history.md v20). With `pattern` only the matching lines are printed.
"""
import re
import sys

lines = open(sys.argv[1]).read().splitlines()
pattern = re.compile(sys.argv[2]) if len(sys.argv) > 2 else None
i = 0
while i < len(lines):
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]{16}) \*/", lines[i])
    m2 = re.search(r"/\* (0x[0-9a-f]{16}) \*/", lines[i + 1]) if m and i + 1 < len(lines) else None
    if not m2:
        i += 1
        continue
    hi = int(m2.group(1), 16)   # the second 64-bit word: control bits 41..61
    stall, wb, rb, mask = (hi >> 41) & 0xF, (hi >> 46) & 7, (hi >> 49) & 7, (hi >> 52) & 0x3F
    waits = "".join(str(b) for b in range(6) if mask >> b & 1) or "-"
    line = (f"{m.group(1)} st={stall:2d} wb={'-' if wb == 7 else wb} rb={'-' if rb == 7 else rb} "
            f"wait={waits:6s} {m.group(2).strip()}")
    if pattern is None or pattern.search(line):
        print(line)
    i += 2
