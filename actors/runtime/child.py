"""``python -m actorlm.actors.child``: the entry of every spawned actor process."""

from .supervisor import child_main

__all__: list[str] = []

if __name__ == "__main__":
    child_main()
