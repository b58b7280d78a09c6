"""The config's edge: the typed settings every worker gets (schema.py, no Hydra), the checks a
composed config passes before any worker starts (validate.py), and Hydra's side of it
(hydra.py: schemas in the ConfigStore, composition, one-line errors)."""
