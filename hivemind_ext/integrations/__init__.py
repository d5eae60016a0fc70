"""Integrations with training frameworks. Each lives in its own module, imported explicitly by the
user (``from hivemind_ext.integrations.lightning import HivemindExtStrategy``), so that
``import hivemind_ext`` never imports a framework the user did not ask for."""
