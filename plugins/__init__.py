"""The plugin layer: what plugin authors import, and the project's own plugin.

A plugin is any module registered under the ``model_support`` entry-point group that implements
one or more hooks from :mod:`model_support.plugins.hookspecs`, marked with :data:`hookimpl`.
"""

from model_support.plugins.hookspecs import PROJECT, hookimpl, hookspec

__all__ = ["PROJECT", "hookimpl", "hookspec"]
