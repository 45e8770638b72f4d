from __future__ import annotations

from django.db import models


class Order(models.Model):
    email = models.TextField()

    class Meta:
        app_label = "shop"
