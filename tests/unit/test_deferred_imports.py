"""tfmulti.utils.deferred_imports on made-up packages in the test's folder (a
"gallery" module with Keras' optional-import block, a "plot" package it names),
and its table against the installed Keras. (Keras itself in fresh processes:
as it ships after `import tfmulti`, deferred in the `tfmulti` command and the
notebook launcher's workers: tests/integration/test_deferred_imports.py.)"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import textwrap
import uuid

import pytest

from tfmulti.utils import deferred_imports

BLOCK = "try:\n    import {plot}.pyplot as plt\nexcept ImportError:\n    plt = None\n"


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Writes made-up packages under tmp_path (on sys.path); returns a function
    `make(files) -> names` with unique package names, forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    made = []

    def make(files: dict[str, str]) -> dict[str, str]:
        names = {key: f"{key}_{uuid.uuid4().hex[:8]}" for key in ("viz", "plot")}
        for path, text in files.items():
            target = tmp_path / path.format(**names)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(textwrap.dedent(text).format(**names))
        made.extend(names.values())
        importlib.invalidate_caches()
        return names

    yield make
    for name in [m for m in sys.modules if m.split(".")[0] in made]:
        del sys.modules[name]


PLOT = {"{plot}/__init__.py": "",
        "{plot}/pyplot.py": "def figure():\n    return 'a figure'\n",
        "{viz}/__init__.py": ""}


def _hook(names, module: str = "gallery", target: str = "pyplot"):
    table = {f"{names['viz']}.{module}": (BLOCK.format(**names), "plt",
                                          f"{names['plot']}.{target}")}
    finder = deferred_imports._Finder(table)
    sys.meta_path.insert(0, finder)
    return finder


def test_the_module_is_imported_where_first_used_and_takes_the_stand_ins_place(packages):
    names = packages({**PLOT, "{viz}/gallery.py": BLOCK + "def draw():\n    return plt.figure()\n"})
    finder = _hook(names)
    gallery = importlib.import_module(f"{names['viz']}.gallery")
    assert names["plot"] not in sys.modules  # not even the package
    assert finder not in sys.meta_path  # its one module loaded: the hook is gone
    assert repr(gallery.plt) == (f"<module '{names['plot']}.pyplot', imported where first "
                                 "used (tfmulti)>")
    assert gallery.draw() == "a figure"
    assert gallery.plt is sys.modules[f"{names['plot']}.pyplot"]


def test_a_module_imported_before_is_bound_as_before(packages):
    names = packages({**PLOT, "{viz}/gallery.py": BLOCK})
    pyplot = importlib.import_module(f"{names['plot']}.pyplot")
    _hook(names)
    assert importlib.import_module(f"{names['viz']}.gallery").plt is pyplot


def test_a_block_that_differs_is_imported_as_without_tfmulti(packages):
    # A Keras that changed the block: the hook does not guess, the module imports eagerly.
    names = packages({**PLOT, "{viz}/gallery.py": "import {plot}.pyplot as plt\n"})
    finder = _hook(names)
    gallery = importlib.import_module(f"{names['viz']}.gallery")
    assert gallery.plt is sys.modules[f"{names['plot']}.pyplot"]
    assert finder not in sys.meta_path


def test_a_package_that_is_not_installed_stays_none(packages):
    names = packages({"{viz}/__init__.py": "", "{viz}/gallery.py": BLOCK})
    _hook(names)
    assert importlib.import_module(f"{names['viz']}.gallery").plt is None


def test_a_deferred_module_importing_another_keeps_refusing_until_its_own_block(packages):
    # As keras' plot_bounding_box_gallery imports plot_image_gallery before its own block.
    names = packages({**PLOT, "{plot}/patches.py": "",
                      "{viz}/gallery.py": BLOCK,
                      "{viz}/boxes.py": "from {viz} import gallery\n"
                                        "try:\n    from {plot} import patches\n"
                                        "except ImportError:\n    patches = None\n"})
    table = {f"{names['viz']}.gallery": (BLOCK.format(**names), "plt", f"{names['plot']}.pyplot"),
             f"{names['viz']}.boxes": (f"    from {names['plot']} import patches\n", "patches",
                                       f"{names['plot']}.patches")}
    finder = deferred_imports._Finder(table)
    sys.meta_path.insert(0, finder)
    boxes = importlib.import_module(f"{names['viz']}.boxes")
    assert names["plot"] not in sys.modules
    assert isinstance(boxes.patches, deferred_imports._Deferred)
    assert isinstance(boxes.gallery.plt, deferred_imports._Deferred)
    assert finder not in sys.meta_path
    # Other imports of the package, outside those modules, are not refused.
    assert importlib.import_module(f"{names['plot']}.pyplot").figure() == "a figure"


FRAMES = {"{plot}/__init__.py": "class Frame:\n    pass\n\n\nclass Series:\n    pass\n",
          "{viz}/__init__.py": "",
          "{viz}/slicing.py": ("try:\n    import {plot}\nexcept ImportError:\n    {plot} = None\n"
                               "TYPES = (list,)\nif {plot}:\n"
                               "    TYPES = TYPES + ({plot}.Series, {plot}.Frame)\n")}


def _frames_hook(names):
    table = {f"{names['viz']}.slicing": (f"    {names['plot']} = None\n", names["plot"],
                                         names["plot"])}
    tuples = {f"{names['viz']}.slicing": ("TYPES = (list,)\n", "TYPES", ("Series", "Frame"))}
    sys.meta_path.insert(0, deferred_imports._Finder(table, tuples))


def test_type_checks_against_a_deferred_package_answer_without_importing_it(packages):
    # As Keras' array_slicing: pandas' DataFrame and Series in the tuple of array types.
    names = packages(FRAMES)
    _frames_hook(names)
    slicing = importlib.import_module(f"{names['viz']}.slicing")
    stand_in = getattr(slicing, names["plot"])
    assert slicing.TYPES == (list, stand_in.Series, stand_in.Frame)
    assert not isinstance(3, slicing.TYPES) and not isinstance(3, stand_in.Frame)
    assert isinstance([], slicing.TYPES)
    assert names["plot"] not in sys.modules  # asked, not imported
    frames = importlib.import_module(names["plot"])  # as the program that makes a Frame does
    assert isinstance(frames.Frame(), slicing.TYPES) and isinstance(frames.Series(), stand_in.Series)
    assert not isinstance(frames.Series(), stand_in.Frame)
    assert issubclass(frames.Frame, stand_in.Frame)
    assert getattr(slicing, names["plot"]) is stand_in  # type checks alone keep the stand-in
    assert stand_in.__name__ == names["plot"]  # any other attribute: the module itself
    assert getattr(slicing, names["plot"]) is frames


def test_a_tuple_block_that_differs_leaves_the_module_to_import_as_without_tfmulti(packages):
    names = packages({**FRAMES, "{viz}/slicing.py": FRAMES["{viz}/slicing.py"].replace(
        "TYPES = (list,)", "TYPES = (tuple,)")})
    _frames_hook(names)
    slicing = importlib.import_module(f"{names['viz']}.slicing")
    frames = sys.modules[names["plot"]]
    assert slicing.TYPES == (tuple, frames.Series, frames.Frame)


def test_the_table_matches_the_installed_keras():
    """Each block is Keras' own, as installed: a Keras that rewrites one fails here
    (the hook would leave that module to import eagerly; the table needs a look)."""
    for name, (block, attribute, target) in deferred_imports.DEFERRED.items():
        parent, _, _ = name.rpartition(".")
        spec = importlib.machinery.PathFinder.find_spec(
            name, importlib.import_module(parent).__path__)
        source = spec.loader.get_source(name)
        assert block in source, name
        assert f"    {attribute} = None\n" in block and target.partition(".")[0] in block
        if name in deferred_imports.CLASS_TUPLES:
            tuple_block, tuple_name, classes = deferred_imports.CLASS_TUPLES[name]
            assert tuple_block in source, name
            assert f"({', '.join(f'{attribute}.{c}' for c in classes)})" in tuple_block
            assert tuple_block.startswith(f"{tuple_name} = ")


def test_install_does_nothing_where_keras_is_loaded_or_when_turned_off(monkeypatch):
    import keras  # noqa: F401  (in this process its modules are loaded)

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = list(sys.meta_path)
    deferred_imports.install()
    assert sys.meta_path == before
    for name in deferred_imports.DEFERRED:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv(deferred_imports.OFF_VARIABLE, "0")
    deferred_imports.install()
    assert sys.meta_path == before and not deferred_imports.installed()
    monkeypatch.delenv(deferred_imports.OFF_VARIABLE)
    deferred_imports.install()
    assert deferred_imports.installed()
    deferred_imports.install()  # once
    assert sum(isinstance(f, deferred_imports._Finder) for f in sys.meta_path) == 1
