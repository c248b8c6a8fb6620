"""Text shipped with the package (public domain; provenance in ``README.md`` here)."""

from __future__ import annotations

from importlib import resources

__all__ = ["emma_opening", "austen_novels", "AUSTEN_TITLES"]

#: The title line that opens each novel in ``austen/train.txt``, in file order, and the name
#: :func:`austen_novels` gives it.
AUSTEN_TITLES = {"pride_and_prejudice": "PRIDE AND PREJUDICE\n",
                 "sense_and_sensibility": "SENSE AND SENSIBILITY\n",
                 "mansfield_park": "MANSFIELD PARK\n", "emma": "EMMA\n",
                 "northanger_abbey": "NORTHANGER ABBEY\n"}


def emma_opening() -> str:
    """The first 20,000 characters of Jane Austen's *Emma* (1815), public domain."""
    return resources.files(__name__).joinpath("emma_opening.txt").read_text(encoding="utf-8")


def austen_novels() -> dict[str, str]:
    """Jane Austen's six novels as separate documents: the five of ``austen/train.txt``,
    split at their title lines, and ``persuasion``, the opening 49,932 characters of
    *Persuasion* (``austen/valid.txt``; the package ships no more of it)."""
    folder = resources.files(__name__).joinpath("austen")
    train = folder.joinpath("train.txt").read_text(encoding="utf-8")
    starts = []
    for name, title in AUSTEN_TITLES.items():
        at = train.index(title, starts[-1][1] + 1 if starts else 0)
        if at and train[at - 1] != "\n":
            raise ValueError(f"austen/train.txt: the title of {name} is not at a line start")
        starts.append((name, at))
    ends = [at for _, at in starts[1:]] + [len(train)]
    novels = {name: train[at:end].strip() for (name, at), end in zip(starts, ends, strict=True)}
    novels["persuasion"] = folder.joinpath("valid.txt").read_text(encoding="utf-8").strip()
    return novels
