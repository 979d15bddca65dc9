"""tfmulti.config.user_functions: the user's `package.module:function`, found, checked, called."""

from __future__ import annotations

import os
import sys

import pytest

from tfmulti.config import user_functions as hooks


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `userhooks.py` in a fresh current directory (not yet on sys.path)."""
    (tmp_path / "userhooks.py").write_text(
        "VALUE = 3\n"
        "def build(input_shape, num_classes=10):\n"
        "    return ('model', input_shape, num_classes)\n"
        "def anything(**kwargs):\n"
        "    return sorted(kwargs)\n"
        "def needs(extra):\n"
        "    return extra\n")
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    (tmp_path / "raising.py").write_text("raise RuntimeError('config file missing')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in ("userhooks", "broken", "raising"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def test_resolves_a_function_from_the_current_directory(user_module):
    fn = hooks.resolve("userhooks:build", "model")
    assert fn((4,)) == ("model", (4,), 10)


def test_a_callable_is_itself():
    def build():
        return 1
    assert hooks.resolve(build, "model") is build


@pytest.mark.parametrize("spec, message", [
    ("nomodule:build", r"`model` 'nomodule:build': no module named 'nomodule' in the current "
                       r"directory \(.*\) or on sys.path; run from the folder that holds "
                       r"nomodule.py"),
    ("userhooks:missing", r"module 'userhooks' \(.*userhooks.py\) has no 'missing'; its "
                          r"functions: \['anything', 'build', 'needs'\]"),
    ("userhooks:VALUE", r"`model` 'userhooks:VALUE' names an object of type int, not a function"),
    ("broken:build", r"importing 'broken' failed: No module named 'not_a_module_anywhere'"),
    ("raising:build", r"importing 'raising' raised RuntimeError: config file missing"),
])
def test_errors_name_the_value_and_the_fix(user_module, spec, message):
    with pytest.raises(ValueError, match=message):
        hooks.resolve(spec, "model")


def test_call_passes_what_the_function_takes(user_module):
    offered = {"input_shape": (3,), "num_classes": 5, "seed": 1}
    assert hooks.call(hooks.resolve("userhooks:build", "model"), offered, "model") \
        == ("model", (3,), 5)
    assert hooks.call(hooks.resolve("userhooks:anything", "model"), offered, "model") \
        == ["input_shape", "num_classes", "seed"]
    assert hooks.parameters(hooks.resolve("userhooks:anything", "model")) is None
    assert hooks.parameters(hooks.resolve("userhooks:build", "model")) == {
        "input_shape", "num_classes"}


def test_call_refuses_a_required_argument_it_cannot_give(user_module):
    with pytest.raises(ValueError, match=r"the dataset function needs requires \['extra'\], "
                                         r"which tfmulti does not provide; it may take any of "
                                         r"\['seed'\]"):
        hooks.call(hooks.resolve("userhooks:needs", "dataset"), {"seed": 0}, "dataset")


def test_the_current_directory_never_shadows_the_standard_library(user_module, monkeypatch):
    """Issue 27: a `configparser.py` in the current directory ran once a hook had put the
    directory first on sys.path. Now the directory goes after the standard library: the
    user's module is found, and `configparser` (imported by that module, or later) is the
    standard library's."""
    ran = user_module / "shadow-ran"
    (user_module / "configparser.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    (user_module / "usesstdlib.py").write_text(
        "import configparser\n"
        "import userhooks\n"  # a sibling module in the same folder is found too
        "def build():\n"
        "    return configparser.ConfigParser, userhooks.VALUE\n")
    for name in ("configparser", "usesstdlib"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    standard = os.path.dirname(os.__file__)
    fn = hooks.resolve("usesstdlib:build", "model")
    parser, value = fn()
    assert value == 3  # the user's modules in the current directory are found
    assert os.path.dirname(sys.modules["configparser"].__file__) == standard
    monkeypatch.delitem(sys.modules, "configparser")
    import configparser  # after the hook, as any later import in the process
    assert os.path.dirname(configparser.__file__) == standard
    assert parser.__module__ == "configparser" and not ran.exists()
    assert str(user_module) in sys.path  # found there, after the standard library's entries
    assert sys.path.index(str(user_module)) > sys.path.index(standard)


@pytest.mark.parametrize("flag", ["model", "dataset", "loss"])
def test_the_help_of_hook_flags_says_they_run_code(flag):
    """Issue 27: nothing said that a hook string imports and runs code."""
    from absl import flags

    from tfmulti.config import flags as config_flags

    fv = flags.FlagValues()
    config_flags.define_absl_flags(fv)
    assert (f"running their code as python -m would (--{flag}=os:abort calls os.abort): pass "
            f"only strings you trust.") in fv[flag].help


def test_a_loss_that_cannot_take_y_true_and_y_pred_is_refused_in_one_line():
    def three(y_true, y_pred, extra):
        return y_pred

    with pytest.raises(ValueError, match=r"^`loss` .*three\(y_true, y_pred, extra\) must take 2 "
                                         r"arguments \(y_true, y_pred\); define it as "
                                         r"def three\(y_true, y_pred\)\.$"):
        hooks.check_takes(three, ("y_true", "y_pred"), "loss")
    hooks.check_takes(lambda y_true, y_pred, sample_weight=None: y_pred, ("a", "b"), "loss")
    hooks.check_takes(lambda *args: args, ("a", "b"), "loss")
    hooks.check_takes(max, ("a", "b"), "loss")  # a builtin: left to the call


def test_build_run_refuses_a_loss_hook_of_three_arguments_before_training(tmp_path,
                                                                          monkeypatch):
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.training.run import build_run

    (tmp_path / "threeloss.py").write_text("def loss(a, b, c):\n    return a\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ValueError, match=r"^`loss` loss\(a, b, c\) must take 2 arguments"):
        build_run(TrainConfig(dataset="synthetic", num_examples=64, loss="threeloss:loss",
                              distribution="one_device", global_batch_size=16, epochs=1))
