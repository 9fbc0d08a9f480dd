"""Pipeline parallelism (docs/pipeline.md): the model split into stages over ``mesh.pp``.

- ``split``: which stage owns which module, on which pp rank, and a stage's module; pure,
  runs on meta.
- ``contract``: each stage's forward run on meta before any process group starts (the stage
  contract: what a stage receives and sends).
- ``stages``: this rank's stages, each parallelized by the plan, wrapped in ``PipelineStage``,
  and the schedule.
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "contract": ["stage_contract"],
    "split": ["PipelineSplit", "Stage", "split_stages", "stage_module"],
    "stages": ["Pipeline", "apply_pipeline", "build_schedule"],
})
