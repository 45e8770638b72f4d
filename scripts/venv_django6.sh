#!/usr/bin/env bash
# Creates .venv-django6: Python >= 3.12 (Django 6 needs it), duetime editable, Django 6,
# psycopg and pytest, for tests/integration/test_django_tasks.py (the Django Tasks
# backend, duetime.contrib.django). The interpreter: $PY_DJANGO6, else the first of
# python3.13, python3.12 (PATH) and ~/.pyenv/versions/3.1[2-9]* that runs and is >= 3.12.
# Without one this prints why and exits 0: the rest of the suite runs, and that test
# fails saying the same.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-django6
STAMP=$VENV/.installed

usable() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && usable "$VENV/bin/python"; then
  exit 0
fi
candidates=()
[ -n "${PY_DJANGO6:-}" ] && candidates+=("$PY_DJANGO6")
candidates+=(python3.13 python3.12)
for dir in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*; do
  [ -x "$dir/bin/python3" ] && candidates+=("$dir/bin/python3")
done
python=""
for candidate in "${candidates[@]}"; do
  if usable "$candidate"; then python=$candidate; break; fi
done
if [ -z "$python" ]; then
  echo "venv-django6: no Python >= 3.12 found (set PY_DJANGO6=/path/to/python3.12);" \
    "tests/integration/test_django_tasks.py will fail until it exists" >&2
  exit 0
fi
rm -rf "$VENV"
"$python" -m venv "$VENV"
"$VENV/bin/pip" install -q -e . 'django>=6,<7' 'psycopg[binary]>=3.1' 'pytest>=8' 2>&1 \
  | { grep -v "^WARNING: Location 'file:" || true; }
"$VENV/bin/python" -c 'import django, duetime; assert django.VERSION >= (6,)'
touch "$STAMP"
echo "venv-django6: $VENV with $("$VENV/bin/python" -V) and Django $("$VENV/bin/python" -m django --version)"
