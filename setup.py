"""Packages and their folders (the rest of the metadata is in pyproject.toml).

The top-level folders `workers/` and `clients/` install under project-specific names,
`tltd_workers` and `tltd_clients`, so that they cannot collide with other projects' packages.
"""

from setuptools import find_packages, setup

FOLDERS = {"tltd_workers": "workers", "tltd_clients": "clients"}


def packages() -> list[str]:
    found = find_packages(include=["tltd", "tltd.*"])
    for name, folder in FOLDERS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=packages(), package_dir=FOLDERS)
