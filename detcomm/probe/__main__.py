"""``python -m detcomm.probe {collectives,model,hf,rows,tp-compare,align} [options]``: the invariance probes
(docs/spec.md section 7).

collectives, model, hf and align are collective programs: start them on every rank (detcomm-launch, torchrun or
mpiexec); rows and tp-compare run in one process.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

_COMMANDS = ("collectives", "model", "hf", "rows", "tp-compare", "align")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _COMMANDS:
        print(f"usage: python -m detcomm.probe {{{','.join(_COMMANDS)}}} [options]   (--help after one for its options)",
              file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    # Imported on demand: the rows mapper needs no process group and should not pay for the model.
    if command == "collectives":
        from .collectives import main as run
    elif command == "model":
        from .model_probe import main as run
    elif command == "hf":
        from .hf_probe import main as run
    elif command == "tp-compare":
        from .tp_compare import main as run
    elif command == "align":
        from .align import main as run
    else:
        from .rows import main as run
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
