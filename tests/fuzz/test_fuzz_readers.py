"""Crafted files never crash optkit's readers: thousands of structure-aware mutants of valid GGUF
files, config.json files, optkit.json manifests and recipes (tests/fuzz/*_mutants.py), each read
in a long-lived worker process under a cap on its address space and a 5 s alarm per mutant
(tests/fuzz/worker.py), and about twenty per reader through the `optkit` command's own entry
point. Every outcome is an answer, or exit 2 with one short line; never exit 3, a signal, a
MemoryError or a run past the alarm. At least 30% of the mutants must get past the header, so the
mutants reach the readers' checks, not only their first one. Seeded: the same mutants every run.

The CLI's mutants run `optkit.cli.main.main` inside the worker (sys.argv set, its SystemExit read):
the same handler and exit codes as the console script, without 2-3 s of interpreter start-up per
mutant, and still in the sandbox where a crash is an outcome."""

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fuzz import gguf_mutants, seeds, tree_mutants
from tests.fuzz.harness import Tally, Worker, cli_problem, reader_problem

pytestmark = pytest.mark.slow

MUTANTS = {"gguf": 3000, "config": 3000, "manifest": 2000, "recipe": 2000}
CLI_MUTANTS = 20
MAX_FAILURE_CLASSES = 25  # a reader broken this often is reported without waiting for the rest
# `optkit ...` per reader: argv ({path}: the mutant; {slot}: the directory it completes), allowed exits
GGUF_CLI = [(["verify", "{path}"], (0, 2)), (["inspect", "{path}"], (0, 2)), (["inspect", "{path}", "--json"], (0, 2))]
MANIFEST_CLI = [  # verify's exit 1: the files differ from optkit.json
    (["verify", "{slot}"], (0, 1, 2)),
    (["inspect", "{slot}"], (0, 2)),
    (["inspect", "{slot}", "--json"], (0, 2)),
]
CLI = {
    "gguf": GGUF_CLI,
    "config": [(["generate", "{slot}", "abc", "--max-tokens", "2", "--device", "cpu"], (0, 2))],
    "manifest": MANIFEST_CLI,
    # the base model never resolves: a recipe that validates stops there, before any work
    "recipe": [(["run", "{path}", "--out", "{slot}/release-{n}"], (2,))],
}


def _slot(root: Path, reader: str):
    """(the directory a mutant completes, a directory of the valid seeds, rng -> (mutant, mutation names))."""
    slot, valid = root / reader, root / f"{reader}-seeds"
    valid.mkdir()
    if reader == "gguf":
        slot.mkdir()
        files = [p.read_bytes() for p in seeds.gguf_seeds(valid)]
        return slot, valid, lambda rng: gguf_mutants.mutate(rng.choice(files), rng)
    if reader == "config":
        shutil.copytree(seeds.model_dir_for_configs(root), slot)
        configs = seeds.config_seeds()
        for i, config in enumerate(configs):
            (valid / f"{i:02d}.json").write_text(json.dumps(config))
        return slot, valid, lambda rng: tree_mutants.json_mutant(rng.choice(configs), rng, tree_mutants.CONFIG_KEYS)
    if reader == "manifest":
        shutil.copytree(seeds.artifact(root), slot)
        shutil.copyfile(slot / "optkit.json", valid / "optkit.json")
        manifest = json.loads((slot / "optkit.json").read_text())
        return slot, valid, lambda rng: tree_mutants.json_mutant(manifest, rng, tree_mutants.MANIFEST_KEYS)
    slot.mkdir()
    recipes = seeds.recipe_seeds()
    for i, recipe in enumerate(recipes):
        (valid / f"{i:02d}.yaml").write_text(recipe)
    return slot, valid, lambda rng: tree_mutants.yaml_mutant(rng.choice(recipes), rng, tree_mutants.RECIPE_KEYS)


def fuzz(reader: str, root: Path, slot: Path, valid: Path, mutant_of) -> tuple[Tally, Tally]:
    mutants = root / f"{reader}-mutants"
    mutants.mkdir()
    rng = random.Random(f"optkit-fuzz-{reader}")
    worker = Worker(reader, slot, valid, [argv for argv, _ in CLI[reader]])
    in_process, cli = Tally(reader), Tally(f"{reader} via the CLI")
    try:
        for i in range(MUTANTS[reader] + CLI_MUTANTS):
            data, mutations = mutant_of(rng)
            path = mutants / f"{i:05d}{'.gguf' if reader == 'gguf' else '.yaml' if reader == 'recipe' else '.json'}"
            path.write_bytes(data)
            if i < MUTANTS[reader]:
                answer = worker.ask({"path": str(path)})
                in_process.add(answer, reader_problem(answer), path, mutations)
            else:
                argv, allowed = CLI[reader][i % len(CLI[reader])]
                argv = [a.replace("{n}", str(i)) for a in argv]
                answer = worker.ask({"path": str(path), "argv": argv})
                cli.add(answer, cli_problem(answer, allowed, "--json" in argv), path, [*mutations, " ".join(argv)])
            if len(in_process.failures) + len(cli.failures) >= MAX_FAILURE_CLASSES:
                break
    finally:
        worker.close()
    return in_process, cli


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[Tally, Tally]]:
    """Every reader fuzzed at once, one worker each: the CPUs share the work."""
    root = tmp_path_factory.mktemp("fuzz")
    slots = {reader: _slot(root, reader) for reader in MUTANTS}  # here: transformers' imports are not thread-safe
    with ThreadPoolExecutor(len(MUTANTS)) as pool:
        runs = {reader: pool.submit(fuzz, reader, root, *slots[reader]) for reader in MUTANTS}
        return {reader: run.result() for reader, run in runs.items()}


@pytest.mark.parametrize("reader", list(MUTANTS))
def test_crafted_files_get_an_answer_or_one_line_never_a_crash(reader, outcomes):
    in_process, cli = outcomes[reader]
    report = f"{in_process.report()}\n{cli.report()}"
    print(report)
    assert not in_process.failures and not cli.failures, report
    assert in_process.mutants == MUTANTS[reader] and cli.mutants == CLI_MUTANTS
    assert in_process.past_header >= 0.3 * in_process.mutants, report
