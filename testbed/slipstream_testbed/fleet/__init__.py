"""Fleet-scale runs of the operator: fake sidecars for thousands of pods, and the bench's
driver (see ``docs/scale.md``)."""
