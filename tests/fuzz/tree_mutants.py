"""Structure-aware mutants of JSON and YAML files (config.json, optkit.json, recipes): the valid
document is parsed, one to four of its fields change (a value, its type, a key dropped, added or
misspelt, a list grown or emptied, a value nested deep, the document replaced by another kind),
and it is written back; then, sometimes, the text itself changes (cut short, not UTF-8, a BOM,
another encoding, a duplicate key, a number of 5,000 digits) or, for YAML, takes what only YAML
has (anchors and aliases, merge keys, tags, complex keys, several documents, flow nesting)."""

import json
import random
import re

import yaml

from tests.fuzz import values

DEEP = "\x00DEEP\x00"  # replaced in the text by nesting too deep to build as Python objects

# keys the readers look at, beyond those the seed holds
CONFIG_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
    "rope_scaling", "tie_word_embeddings", "eos_token_id", "bos_token_id", "attention_bias", "mlp_bias", "hidden_act",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "text_config", "num_experts",
    "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "embedding_multiplier", "residual_multiplier",
    "attention_multiplier", "logits_scaling", "query_pre_attn_scalar", "final_logit_softcapping",
    "attn_logit_softcapping", "sliding_window_pattern", "rope_local_base_freq", "partial_rotary_factor",
    "original_max_position_embeddings", "quantization_config", "rope_type", "factor", "short_factor", "long_factor",
    "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "hidden_activation",
)  # fmt: skip
MANIFEST_KEYS = (
    "files", "method", "options", "format", "base_model", "calibration", "ignored_layers", "versions", "created",
    "wall_time_s", "layers", "gate", "compile", "recipe", "optkit_version", "name", "shape", "rel_error", "mse",
    "path", "sha256", "weights", "bits", "group_size", "symmetric", "loss",
)  # fmt: skip
RECIPE_KEYS = (
    "model", "stages", "quantize", "gate", "output", "compile", "serve", "method", "weights", "bits", "group_size",
    "symmetric", "format", "calibration", "calib", "num_samples", "seq_len", "seed", "eval_set", "max_kld",
    "max_ppl_increase", "min_top1", "task", "min_recovery", "repair", "batch_sizes", "device", "dtype",
    "torch_compile", "engine", "compile_dir", "max_model_len", "ignore", "gptq", "awq", "smoothquant", "damp",
    "block_size", "alpha", "activations", "act_order", "dynamic", "targets", "tiers", "routing",
)  # fmt: skip


def _nodes(doc, path=()):
    """(path, value) of every node, the document itself first."""
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:50]):
            yield from _nodes(v, (*path, i))


def _set(doc, path, value):
    if not path:
        return value
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


def mutate_tree(doc, rng: random.Random, keys: tuple[str, ...]):
    """The document with one to four fields changed, and the names of the changes."""
    names = []
    for _ in range(rng.choice((1, 1, 2, 2, 3, 4))):
        nodes = list(_nodes(doc))
        path, node = rng.choice(nodes[1:] or nodes)
        op = rng.choices(
            ("value", "type", "drop", "add", "rename", "list", "nest", "whole"), (10, 4, 4, 4, 2, 2, 2, 1)
        )[0]
        where = ".".join(map(str, path))
        if op == "value":
            doc = _set(doc, path, values.scalar(rng, node))
        elif op == "type":
            doc = _set(doc, path, _retype(node, rng))
        elif op == "drop" and path:
            parent = _parent(doc, path)
            del parent[path[-1]]
        elif op == "add":
            dicts = [p for p, n in nodes if isinstance(n, dict)]
            target = _get(doc, rng.choice(dicts)) if dicts else None
            if target is not None:
                key = rng.choice(keys) if rng.random() < 0.8 else rng.choice(("", "x", "1", "__class__", "a.b"))
                target[key] = values.scalar(rng)
                where = key
        elif op == "rename" and path and isinstance(path[-1], str):
            parent = _parent(doc, path)
            parent[_typo(path[-1], rng)] = parent.pop(path[-1])
        elif op == "list":
            many = 1000 if not isinstance(node, (dict, list)) else 20
            doc = _set(doc, path, rng.choice(([], [node], [node] * many, [node, node])))
        elif op == "nest":
            depth = rng.choice((2, 10, 100, 1000))
            for _ in range(depth if depth < 200 else 0):
                node = [node] if rng.random() < 0.5 else {"a": node}
            doc = _set(doc, path, node if depth < 200 else DEEP)
        elif op == "whole":
            doc = rng.choice(([], [doc], "text", 1, None, True, {}))
        names.append(f"{op}:{where}")
    return doc, names


def _get(doc, path):
    for key in path:
        doc = doc[key]
    return doc


def _parent(doc, path):
    return _get(doc, path[:-1])


def _retype(node, rng: random.Random):
    if isinstance(node, dict):
        return rng.choice((list(node.values()), list(node), json.dumps(node), None))
    if isinstance(node, list):
        return rng.choice((dict(enumerate(node)), {str(i): v for i, v in enumerate(node)}, str(node), len(node)))
    if isinstance(node, bool):
        return rng.choice((int(node), str(node).lower(), [node]))
    if isinstance(node, (int, float)):
        integral = int(node) if node == node and abs(node) < 1e18 else 0
        return rng.choice((str(node), [node], {"value": node}, float(node) if isinstance(node, int) else integral))
    return rng.choice(([node], {"value": node}, 0, None))


def _typo(key: str, rng: random.Random) -> str:
    if not key:
        return "x"
    i = rng.randrange(len(key))
    return rng.choice((key[:i] + key[i + 1 :], key.upper(), key + "_", key.replace("_", "-"), key + " "))


def _deep(rng: random.Random, yaml_flow: bool = False) -> str:
    depth = rng.choice((1000, 5000, 20_000, 100_000))
    return "[" * depth + "1" + "]" * depth if rng.random() < 0.7 or yaml_flow else '{"a":' * depth + "1" + "}" * depth


def json_mutant(seed: dict, rng: random.Random, keys: tuple[str, ...]) -> tuple[bytes, list[str]]:
    doc, names = mutate_tree(json.loads(json.dumps(seed)), rng, keys)
    text = json.dumps(doc, indent=rng.choice((None, 2))).replace(json.dumps(DEEP), _deep(rng))
    data = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.2:
        data, name = _text_mutation(data, rng, json_text=True)
        names.append(name)
    return data, names


class _PlainDumper(yaml.SafeDumper):
    """Shared values written out each time: aliases come only from the YAML-text mutations."""

    def ignore_aliases(self, data) -> bool:
        return True


def yaml_mutant(seed: str, rng: random.Random, keys: tuple[str, ...]) -> tuple[bytes, list[str]]:
    if rng.random() < 0.2:  # what only YAML text can say
        text, name = _yaml_text(seed, rng)
        return text.encode("utf-8", "surrogatepass"), [name]
    doc, names = mutate_tree(yaml.safe_load(seed), rng, keys)
    text = yaml.dump(
        doc,
        Dumper=_PlainDumper,
        sort_keys=False,
        allow_unicode=rng.random() < 0.5,
        default_flow_style=rng.choice((False, None)),
    )
    text = text.replace(DEEP, _deep(rng, yaml_flow=True))
    data = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.15:
        data, name = _text_mutation(data, rng, json_text=False)
        names.append(name)
    return data, names


def _text_mutation(data: bytes, rng: random.Random, json_text: bool) -> tuple[bytes, str]:
    op = rng.choice(("cut", "bad_utf8", "bom", "utf16", "latin1", "digits", "dup_key", "nan", "empty", "garbage"))
    if op == "cut":
        return data[: rng.randrange(len(data) + 1)], op
    if op == "bad_utf8":
        i = rng.randrange(len(data) + 1)
        return data[:i] + rng.choice(values.BAD_BYTES) + data[i:], op
    if op == "bom":
        return b"\xef\xbb\xbf" + data, op
    if op == "utf16":
        return data.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass"), op
    if op == "latin1":
        return data.replace(b"e", b"\xe9"), op
    if op == "digits":  # Python refuses to turn more than 4,300 digits into an int
        return data.replace(b"1", b"1" + b"7" * rng.choice((400, 5000)), 1), op
    if op == "dup_key" and json_text and data.startswith(b"{"):
        return b'{"model_type": "llama", "model_type": 7, ' + data[1:], op
    if op == "nan":
        return data.replace(b"1", b"NaN" if json_text else b".nan", 1), op
    if op == "empty":
        return b"", op
    return data + rng.choice((b"\n}\n", b"\x00", b"\n---\nb: 1\n", b"\x1b[2J")), op


def _replace_value(seed: str, key: str, value: str) -> str:
    """`key: old` (the first, a scalar) as `key: value`; appended at the top level if there is none."""
    new, n = re.subn(rf"\b{key}: [^,}}\n]+", lambda _: f"{key}: {value}", seed, count=1)
    return new if n else seed + f"{key}: {value}\n"


def _yaml_text(seed: str, rng: random.Random) -> tuple[str, str]:
    op = rng.choice(("bomb", "bomb", "alias", "merge", "tag", "complex_key", "documents", "deep", "deep", "keys"))
    key = rng.choice(("model", "output", "seed", "bits", "stages", "max_kld"))
    if op == "bomb":  # each level refers to the one below n times: n^levels nodes from a few hundred bytes
        n, levels = rng.choice(((9, 9), (10, 6), (3, 4), (2, 2)))
        chain = ["&b0 [lol]"] + [f"&b{i} [{', '.join([f'*b{i - 1}'] * n)}]" for i in range(1, levels)]
        return _replace_value(seed, key, f"[{', '.join(chain)}]"), f"yaml:bomb:{n}^{levels}:{key}"
    if op == "alias":
        return seed.replace("quantize:", "quantize: &q", 1) + "extra: *q\n", "yaml:alias"
    if op == "merge":
        return "base: &b {bits: 4}\n" + seed.replace("gate:", "gate:\n  <<: *b", 1), "yaml:merge"
    if op == "tag":
        tag = rng.choice(
            ("!!python/object/apply:os.system ['true']", "!!python/name:os.system", "!!binary aGVsbG8=",
             "!!set {a, b}", "!!timestamp 2001-12-14", "!custom x", "!!float .inf", "!!int 0x7fffffffffffffffffff")
        )  # fmt: skip
        return _replace_value(seed, key, tag), f"yaml:tag:{key}"
    if op == "complex_key":
        return seed + rng.choice(
            ("? [a, b]\n: 1\n", "? {a: 1}\n: 2\n", "1: one\n", "null: x\n", "true: y\n")
        ), "yaml:key"
    if op == "documents":
        return seed + "---\n" + seed, "yaml:documents"
    if op == "deep":
        depth = rng.choice((100, 1000, 5000, 20_000))
        if rng.random() < 0.5:
            return _replace_value(seed, key, "[" * depth + "1" + "]" * depth), f"yaml:flow_deep:{depth}"
        depth = min(depth, 600)  # block style indents each level one more column: depth² / 2 bytes
        return seed + "deep:\n" + "".join(" " * i + f"k{i}:\n" for i in range(depth)), f"yaml:block_deep:{depth}"
    return seed + "".join(f"k{i}: {i}\n" for i in range(rng.choice((1000, 5000)))), "yaml:many_keys"
