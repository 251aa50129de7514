"""What a user reads before running anything: the command's help and the recipe reference generated from the
schema (docs/reference/recipe.md, which must not drift from the code)."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from s4accel.config import Recipe
from s4accel.tools import recipe_reference

PAGE = REPO / "docs" / "reference" / "recipe.md"
PAGES = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]  # everything a user reads


def help_text(*args):
    proc = subprocess.run([sys.executable, "-m", "s4accel", *args, "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env={"COLUMNS": "100", "PATH": "", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_command_list_gives_each_command_its_whole_first_sentence():
    text = help_text()
    listed = text.split("Commands:")[1]
    assert "..." not in listed  # click cut each description at 45 characters
    assert "Train the model a recipe describes." in listed
    assert ("Write the model of a training checkpoint (one process, DDP or FSDP-sharded) as a from_pretrained "
            "folder with its tokenizer, code and model card: any step of a run, also of one stopped before its "
            "end.") in " ".join(listed.split())


@pytest.mark.parametrize("command", ["train", "eval", "export", "predict", "generate", "push"])
def test_placeholders_are_readable_and_nothing_is_eaten_as_markup(command):
    text = help_text(command)
    assert "<bool>" not in text and "<str>" not in text and "<path>" not in text and "{" not in text
    usage = text.splitlines()[0]
    assert usage.startswith(f"Usage: s4accel {command} [OPTIONS]") and usage.split()[-1].strip("[]").isupper()
    if command == "eval":
        assert "pip install 's4accel[lm_eval]'" in " ".join(text.split())
        assert "--data PATH" in text and "--limit INTEGER" in text and "--json " in text


def test_train_help_says_where_the_recipe_keys_are_documented():
    assert "docs/reference/recipe.md" in " ".join(help_text("train").split())


def test_the_reference_pages_are_those_the_code_generates():
    """The recipe keys from the schema, the commands from the CLI app: regenerate with `python docs/generate.py`."""
    proc = subprocess.run([sys.executable, str(REPO / "docs" / "generate.py"), "--check"], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert PAGE.read_text() == recipe_reference.page()
    cli = (REPO / "docs" / "reference" / "cli.md").read_text()
    assert all(f"## s4accel {name}\n" in cli for name in ("train", "eval", "export", "predict", "lr-find"))


def test_the_site_builds_in_strict_mode(tmp_path):
    """`make docs`: a broken link or a page left out of the navigation fails the build (mkdocs' strict mode)."""
    pytest.importorskip("mkdocs")
    env = {"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d"]
    proc = subprocess.run([*command, str(tmp_path / "site")], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "site" / "reference" / "recipe" / "index.html").is_file()


def test_the_recipe_reference_lists_every_key_with_its_docstring():
    page = PAGE.read_text()
    for section, field in Recipe.model_fields.items():
        assert f"## `{section}`" in page
    for cls, prefix in ((Recipe.model_fields["train"].annotation, "train"),
                        (Recipe.model_fields["data"].annotation, "data")):
        for name in cls.model_fields:
            row = next(line for line in page.splitlines() if line.startswith(f"| `{prefix}.{name}` |"))
            assert not row.endswith("|  |"), f"{prefix}.{name} has no docstring"
    assert "| `train.compile_mode` | " in page and "`\"default\"`" in page


def test_the_readme_is_two_screens_opens_with_the_two_commands_and_its_links_resolve():
    import re

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    first_block = readme.split("```")[1]
    assert "make quickstart" in first_block and "make test" in first_block
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert links and all((REPO / link).exists() for link in links if not link.startswith("http")), links


def test_every_recipe_key_the_pages_set_is_one_the_recipe_knows():
    """A `--set KEY=VALUE` copied from the README or a page is never refused as an unknown key (placeholders such as
    `SECTION.KEY`, and a key the page itself shows refused, aside). Only the key is checked: a value may stand for
    the reader's own (`model.pretrained=...`)."""
    import re

    from s4accel.config import load_recipe
    from s4accel.errors import RecipeError

    unknown = []
    for page in PAGES:
        text = page.read_text()
        for key, value in set(re.findall(r"--set ([A-Za-z_][\w.]*)=([^\s`\]]*)", text)):
            if key.lower() == "section.key" or f"{key}: unknown key" in text:
                continue
            try:
                load_recipe(REPO / "recipes" / "quickstart.yaml", [f"{key}={value}"])
            except RecipeError as e:
                if f"{key}: unknown key" in str(e):
                    unknown.append(f"{page.relative_to(REPO)}: {key}")
    assert not unknown, unknown


def test_every_recipe_block_of_the_pages_uses_keys_the_recipe_knows():
    """A YAML block of a page (a recipe's sections a reader copies into their own) parses, and each section it gives,
    put in place of the quick-start's, is refused for nothing named there as an unknown key."""
    import re

    import yaml

    from s4accel.config.load import validate_recipe
    from s4accel.errors import RecipeError

    base = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    unknown, blocks = [], 0
    for page in PAGES:
        for block in re.findall(r"(?ms)^```yaml\n(.*?)^```", page.read_text()):
            sections = yaml.safe_load(block)
            blocks += 1
            try:
                validate_recipe({**base, **sections}, source=page.name)
            except RecipeError as e:
                unknown += [line for line in str(e).splitlines() if "unknown key" in line]
    assert blocks >= 15 and not unknown, unknown


def test_the_pages_name_no_path_of_one_machine():
    import re

    roots = "|".join(f"/{name}/" for name in ("tmp", "home", "root", "work", "Users"))  # where one machine's files are
    found = [(p.name, m) for p in PAGES for m in re.findall(rf"(?:{roots})\S*", p.read_text())]
    assert not found, found


@pytest.mark.parametrize("mistake", ["a page left out of the navigation", "a link to a heading that does not exist"])
def test_the_site_build_fails_on_a_page_nobody_can_reach_or_a_broken_anchor(tmp_path, mistake):
    """What a newcomer would hit as a dead end fails `make docs` (mkdocs reports both as info unless told)."""
    import shutil

    pytest.importorskip("mkdocs")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    if mistake.startswith("a page"):
        (tmp_path / "docs" / "how-to" / "orphan.md").write_text("# Nobody links here\n")
    else:
        page = tmp_path / "docs" / "how-to" / "packing.md"
        page.write_text(page.read_text() + "\nSee [nothing](../explanation/measured.md#no-such-heading).\n")
    env = {"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode != 0 and ("orphan.md" in proc.stderr or "no-such-heading" in proc.stderr), proc.stderr
