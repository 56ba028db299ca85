"""What Snapline's command groups share: command summaries are never cut off, and error
messages never show a credential.

Click shortens a command's summary to fit one line of the group's help ("Run the pipeline
SPEC (module:attribute) as one or..."); these groups show the whole first sentence, wrapped.
An error a command ends with can quote a checkpoint URI (``s3://key:secret@bucket``) or a
configuration: its message is redacted before Click prints it.
"""

from __future__ import annotations

from typing import Any

import click

from snapline.connectors.config import redact_text


def click_error(message: str, exit_code: int) -> click.ClickException:
    """A ClickException that exits with ``exit_code`` (click 8.5 declares ``exit_code`` a
    class variable, so it is set on a subclass, not on the instance)."""
    error_type = type("SnaplineExit", (click.ClickException,), {"exit_code": exit_code})
    return error_type(message)


class FullSummaryGroup(click.Group):
    """A ``click.Group`` whose command list shows each command's whole first sentence, and
    whose commands' error messages are redacted (``redact_text``)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            # click 8.5 declares ``message`` Final; it is an instance attribute all the same.
            exc.__dict__["message"] = redact_text(exc.message)
            raise

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is None or command.hidden:
                continue
            rows.append((name, command.get_short_help_str(limit=1000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
