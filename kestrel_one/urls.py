from django.contrib import admin
from django.urls import include, path

from kestrel_one.accounts import views as account_views

urlpatterns = [
    path("api/v1/", include(("kestrel_one.api.urls", "api"))),
    path("login", account_views.LoginView.as_view(), name="login"),
    path(
        "login/set-password/<str:uidb64>/<str:token>/",
        account_views.SetPasswordView.as_view(),
        name="set_password",
    ),
    path("logout", account_views.logout_view, name="logout"),
    # Before the console: /console/oauth/authorize is the OAuth consent page, not an org.
    path("", include("kestrel_one.oauth.urls")),
    path("", include("kestrel_one.console.urls")),
    path("", account_views.home, name="home"),
    path("admin/", admin.site.urls),
]

handler404 = "kestrel_one.console.errors.not_found"
handler500 = "kestrel_one.console.errors.server_error"
