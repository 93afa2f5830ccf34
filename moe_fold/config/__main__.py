"""``python -m moe_fold.config --reference > docs/configuration.md``."""

import sys

from moe_fold.config.reference import reference_markdown


if __name__ == "__main__":
    if sys.argv[1:] != ["--reference"]:
        sys.exit("usage: python -m moe_fold.config --reference > docs/configuration.md")
    sys.stdout.write(reference_markdown())
