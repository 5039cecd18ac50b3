"""A stand-in training process for stack-aggregation tests: it enters ``argv[1]``
(a function below), says so on stdout, and blocks there until stdin closes."""

import sys


def wait_collective():
    announce("wait_collective")
    sys.stdin.read()


def stuck_in_dataloader():
    announce("stuck_in_dataloader")
    sys.stdin.read()


def announce(name):
    sys.stdout.write(f"ready {name}\n")
    sys.stdout.flush()


def train_step(where):
    globals()[where]()


if __name__ == "__main__":
    train_step(sys.argv[1])
