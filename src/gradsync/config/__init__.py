"""The config's edge: the typed settings every worker gets (schema.py, no Hydra), the checks on
a composed config's own values (validate.py; building the parts is run/preflight.py's), and
Hydra's side of it (hydra.py: schemas in the ConfigStore, composition, one-line errors)."""
