from __future__ import annotations

from django.db import models


class Receipt(models.Model):
    email = models.TextField()

    class Meta:
        app_label = "mailer"
