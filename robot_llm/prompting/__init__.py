"""Prompt templates: loading, sanitising the data they show, rendering within the token budget.

A template is a file ``prompts/<name>.j2``: YAML front matter between two ``---`` lines,
then a Jinja2 body (see ``prompts/README.md``). Templates are operator-owned code; news and
signal text is *data*. Data never reaches Jinja as template source: it is passed as
variables, after :func:`~robot_llm.prompting.sanitize.sanitize_text` has neutralised
control characters, template syntax, the tokenizer's special pieces and lines that imitate
the template's own section markers.

One module per step, in the order a prompt is made:

- :mod:`.template`: the front matter's schema and the :class:`~.template.Template` it validates into;
- :mod:`.loading`: finding template files (configured folder, then the bundled ones) and loading them;
- :mod:`.render`: the Jinja sandbox and :func:`~.render.render_prompt`;
- :mod:`.sanitize`: making news and signal text safe to show;
- :mod:`.context`: what a template sees, built from the news and signals gathered;
- :mod:`.budget`: fitting the prompt into the model's window, dropping the least relevant news first;
- :mod:`.stance_prompt`: the content-free calibration context and the stance labels' check.

Nothing is re-exported here: import from the module that does the work.
"""
