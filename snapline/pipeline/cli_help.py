"""Help formatting shared by Snapline's command groups: command summaries are never cut off.

Click shortens a command's summary to fit one line of the group's help ("Run the pipeline
SPEC (module:attribute) as one or..."); these groups show the whole first sentence, wrapped.
"""

from __future__ import annotations

import click


class FullSummaryGroup(click.Group):
    """A ``click.Group`` whose command list shows each command's whole first sentence."""

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
