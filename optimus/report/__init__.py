"""Scaling-efficiency reports from run directories (`optimus report`)."""

from optimus.report.build import build_report
from optimus.report.compare import check_comparable
from optimus.report.runs import ReportError, Run, load_run
from optimus.report.summary import add_efficiency, summarize_run

__all__ = ["ReportError", "Run", "add_efficiency", "build_report", "check_comparable", "load_run", "summarize_run"]
