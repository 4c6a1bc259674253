"""One torchrun-style process running an edgespec command line (for data-parallel tests: a module light to import
in a spawned process, unlike a test module that imports transformers)."""
import os


def cli_worker(rank: int, world: int, port: int, argv: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from runtime.cli import main

    assert main(argv) == 0
