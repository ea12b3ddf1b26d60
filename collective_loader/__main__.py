"""``python -m collective_loader demo [options]``; ``--help`` lists them."""

import sys

from collective_loader.cli.main import main as demo

COMMANDS = {"demo": demo}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m collective_loader {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
