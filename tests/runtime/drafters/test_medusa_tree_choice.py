"""The zoo's Medusa tree: a named tree in runtime/drafters/medusa_trees.json ('zoo', picked by measurement with
scripts/medusa_tree_sweep.py) that the zoo heads' config names, so `edgespec bundle --medusa zoo/medusa` records it
in the `medusa` entry; a config naming a tree the runtime does not ship is refused, naming it."""
from tests.support import REPO_ROOT
import json
import os
import shutil

import pytest

from export.drafters.medusa import read_medusa
from runtime.drafters.medusa import resolve_tree, standard_trees
from runtime.errors import BundleError

REPO = REPO_ROOT
ZOO_HEADS = os.path.join(REPO, "zoo", "medusa")


def test_the_zoo_heads_name_the_shipped_zoo_tree():
    heads = read_medusa(ZOO_HEADS)
    assert heads.tree == "zoo"
    zoo = resolve_tree("zoo", heads.num_heads)
    assert zoo == sorted(standard_trees()["zoo"], key=lambda p: (len(p), p)) and len(zoo) < 16


def test_a_config_naming_an_unknown_tree_is_refused(tmp_path):
    shutil.copy(os.path.join(ZOO_HEADS, "medusa_lm_head.safetensors"), tmp_path)
    cfg = json.load(open(os.path.join(ZOO_HEADS, "config.json")))
    json.dump(dict(cfg, medusa_tree="bushy"), open(tmp_path / "config.json", "w"))
    with pytest.raises(BundleError, match="medusa tree 'bushy' unknown"):
        read_medusa(str(tmp_path)).tree
