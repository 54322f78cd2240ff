"""The project's API: the DisaggDeployment models (``v1alpha1``), the names and
label keys derived from them (``names``) and the CRD generator (``crd``)."""
